"""`create_app(settings)` builds the FastAPI app that `flowlock serve` runs.

One engine per worker process, opened and closed by the app's lifespan. See docs/service.md.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

import flowlock
from flowlock import examples
from flowlock.core.definition import Workflow
from flowlock.core.diagram import load_workflows
from flowlock.engine import Engine, connect
from flowlock.metrics import Metrics
from flowlock.service.admin_routes import admin_routes
from flowlock.service.apidoc import PROBLEM_DOC, document_access
from flowlock.service.bulk_routes import bulk_routes
from flowlock.service.capacity_routes import capacity_routes
from flowlock.service.console import install_console
from flowlock.service.fast import FastRoutes
from flowlock.service.guard import RequestGuard
from flowlock.service.handlers import install_error_handlers
from flowlock.service.health import Probes, health_routes
from flowlock.service.payload_doc import document_payloads
from flowlock.service.routes import definition_routes, instance_routes
from flowlock.service.settings import ServiceSettings

__all__ = ["app_from_env", "create_app", "default_workflows"]


def default_workflows() -> list[Workflow]:
    """What `flowlock serve` serves without `--app`: the seed article's three cases.

    They are approval, countersign (quorum 3) and inventory, whose payload `{"qty": n}` is
    typed (a Pydantic model), so the OpenAPI document shows a declared payload."""
    return [examples.approval(), examples.countersign(3), examples.inventory(typed=True)]


def _engine(settings: ServiceSettings, metrics: Metrics) -> Engine:
    return connect(
        settings.database_url,
        redis_url=settings.redis_url,
        max_size=settings.pool_size,
        strategy=settings.strategy,
        schema=settings.schema,
        metrics=metrics,
        timers=settings.timers,
        outbox=settings.outbox,
    )


def create_app(
    settings: ServiceSettings | None = None, *, workflows: Sequence[Workflow] | None = None
) -> FastAPI:
    """The service over `settings` (default: an in-memory store), serving `workflows`.

    By default it serves what `settings.app` names, else `default_workflows()`.
    Misconfiguration raises InvalidInput here, before anything is opened."""
    settings = settings if settings is not None else ServiceSettings()
    served = list(workflows) if workflows is not None else _served(settings.app)
    metrics = Metrics(CollectorRegistry())
    engine = _engine(settings, metrics)
    probes = Probes()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with engine:
            for wf in served:
                await engine.register(wf)
            try:
                yield
            finally:
                probes.cancel()

    app = FastAPI(
        title="flowlock",
        version=flowlock.__version__,
        summary="Workflow instances whose every transition is applied exactly once.",
        lifespan=lifespan,
        responses={"default": {"description": "An RFC 9457 problem", "content": PROBLEM_DOC}},
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    definition_routes(app, engine)
    instance_routes(app, engine, settings)
    admin_routes(app, engine, settings)
    health_routes(app, engine, settings, metrics, probes)
    bulk_routes(app, engine, settings)
    capacity_routes(app, engine)
    install_console(app, engine, settings, metrics)
    # Added first, so inside the guard: a hot route is refused or let through as any other.
    app.add_middleware(FastRoutes, engine=engine, settings=settings)
    app.add_middleware(
        RequestGuard,
        tokens=settings.api_tokens,
        max_body=settings.max_body_bytes,
        open_metrics=settings.open_metrics,
        insecure=settings.insecure,
    )
    _document_access(app, settings, served)
    return app


def _document_access(app: FastAPI, settings: ServiceSettings, served: list[Workflow]) -> None:
    """The OpenAPI document names the token each operation needs and the served workflows'
    payload schemas (built on first use, when every route, also one added after this, is
    there)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = document_access(build(), open_metrics=settings.open_metrics)
            app.openapi_schema = document_payloads(schema, served)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def app_from_env() -> FastAPI:
    """The app the `FLOWLOCK_*` variables describe (uvicorn's factory in each worker)."""
    return create_app(ServiceSettings.from_env(os.environ))


def _served(reference: str | None) -> list[Workflow]:
    return load_workflows(reference) if reference else default_workflows()
