"""The workflows ``flowlock serve`` serves under ``flowlock bench --http``: ``--app
flowlock_lab.http_app:workflows``.

The service serves only flowlock's examples by default, and the hot and spread scenarios step the
bench's own counter, so the service the bench starts loads this module instead: exactly the
definitions the in-process sessions of the same scenarios register, so a call means the same
thing through either transport.
"""

from __future__ import annotations

from flowlock.bench.config import HTTP_SCENARIOS
from flowlock.bench.results import Params
from flowlock.bench.scenarios import SCENARIOS
from flowlock.core.definition import Workflow

__all__ = ["workflows"]


def workflows() -> list[Workflow]:
    """Every workflow the scenarios ``--http`` runs use (storm's approval, hot's and spread's
    counter), each once. None depends on the number of callers."""
    found: dict[str, Workflow] = {}
    for name in HTTP_SCENARIOS:
        for wf in SCENARIOS[name].workflows(Params()):
            found.setdefault(wf.name, wf)
    return list(found.values())
