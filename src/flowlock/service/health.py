"""The health routes: liveness, readiness of each backend, and Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flowlock.core.errors import FlowlockError
from flowlock.engine import Engine
from flowlock.metrics import Metrics
from flowlock.service.apidoc import ok
from flowlock.service.responses import Live, Ready
from flowlock.service.settings import ServiceSettings

READY_TIMEOUT = 2.0
"""Seconds /readyz gives each backend to answer."""


def health_routes(
    app: FastAPI, engine: Engine, settings: ServiceSettings, metrics: Metrics, probes: Probes
) -> None:
    @app.get(
        "/livez",
        tags=["health"],
        summary="The process is up",
        response_model=None,
        responses=ok(Live, "Up"),
    )
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        summary="PostgreSQL (and Redis) answer",
        response_model=None,
        responses={
            **ok(Ready, "Every backend answered"),
            **ok(Ready, "A backend did not answer (the checks say which)", 503),
        },
    )
    async def readyz() -> Response:
        checks = await _readiness(engine, probes)
        ok = all(v == "ok" for v in checks.values())
        body = {"status": "ok" if ok else "degraded", "checks": checks}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "The Prometheus text exposition format"}},
    )
    async def prometheus() -> Response:
        return Response(_exposition(settings, metrics), media_type=CONTENT_TYPE_LATEST)


class Probes:
    """The readiness pings in flight, one per backend.

    At READY_TIMEOUT a ping is no longer waited for, but never cancelled. Cancelling on a
    hung server holds the task while asyncpg returns the connection, for up to 10 s. The
    ping runs to its own bounds, and a later /readyz waits for it instead of sending
    another. So probes never pile up on a hung server.
    """

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task[None]] = {}

    async def check(self, name: str, ping: Callable[[], Awaitable[None]]) -> str:
        """What ``name``'s ping says within READY_TIMEOUT: "ok", or what went wrong."""
        task = self._running.get(name)
        if task is None or task.done():
            task = self._running[name] = asyncio.ensure_future(ping())
            task.add_done_callback(_retrieved)
        try:
            await asyncio.wait_for(asyncio.shield(task), READY_TIMEOUT)
        except TimeoutError:
            return f"TimeoutError: no answer within {READY_TIMEOUT:g} s"
        except (FlowlockError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        return "ok"

    def cancel(self) -> None:
        """At shutdown: the engine is about to close under any ping still in flight."""
        for task in self._running.values():
            task.cancel()
        self._running.clear()


def _retrieved(task: asyncio.Task[None]) -> None:
    # Marks the outcome as seen: a ping nobody waited for to the end logs nothing at exit.
    if not task.cancelled():
        task.exception()


async def _readiness(engine: Engine, probes: Probes) -> dict[str, str]:
    """Each backend's answer to a ping within READY_TIMEOUT: "ok" or what went wrong."""
    targets: dict[str, Any] = {"database": engine.store}
    if engine.locks is not None:
        targets["locks"] = engine.locks
    checks: dict[str, str] = {}
    for name, target in targets.items():
        ping = getattr(target, "ping", None)
        checks[name] = "ok" if ping is None else await probes.check(name, ping)
    return checks


def _exposition(settings: ServiceSettings, metrics: Metrics) -> bytes:
    """The metrics of every worker when they share a directory, else this process's."""
    if settings.metrics_dir is None:
        return generate_latest(metrics.registry)
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=settings.metrics_dir)  # type: ignore[no-untyped-call]
    return generate_latest(registry)
