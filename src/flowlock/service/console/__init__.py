"""The web console `flowlock serve` serves at /ui: server-rendered pages for operators.

Jinja2 templates and static files (the stylesheet, and htmx for the live monitor panel) ship
inside this package; nothing is fetched from another host. Pages read through the engine's
API; force, pause and resume go through the engine's repair calls after a confirmation. See
docs/console.md.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("jinja2", "service", "flowlock serve's console")

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from flowlock.engine import Engine
from flowlock.metrics import Metrics
from flowlock.service.console.actions import install_actions
from flowlock.service.console.auth import Gate, install_login
from flowlock.service.console.pages import install_pages
from flowlock.service.console.session import Keys
from flowlock.service.settings import ServiceSettings

__all__ = ["install_console"]


def install_console(
    app: FastAPI, engine: Engine, settings: ServiceSettings, metrics: Metrics | None
) -> None:
    """The console's routes on `app`, under /ui (none of them in the OpenAPI document)."""
    gate = Gate(Keys(settings.api_tokens))
    static = StaticFiles(packages=[("flowlock.service.console", "static")])
    app.mount("/ui/static", static, name="console-static")
    install_login(app, gate)
    install_actions(app, engine, gate)
    install_pages(app, engine, gate, metrics)
