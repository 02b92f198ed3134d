"""`flowlock serve`: uvicorn running the app in worker processes, with `--dev` servers.

Settings reach the workers as `FLOWLOCK_*` variables. Several workers share Prometheus
metrics through a directory made for the run. Shutdown is in docs/service.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from flowlock.core.errors import InvalidInput
from flowlock.service.settings import ServiceSettings

__all__ = ["Listen", "is_loopback", "serve"]

_ONE_PROCESS = ("memory://", "sqlite:")


@dataclass(frozen=True, slots=True)
class Listen:
    """Where and how uvicorn listens."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    log_level: str = "info"
    insecure: bool = False
    """Listen on `host` even when it is not a loopback address and no token is set."""


def is_loopback(host: str) -> bool:
    """Whether `host` is `localhost` or an address of 127.0.0.0/8 or ::1 (brackets allowed)."""
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # a host name: it may resolve to anything
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check(settings: ServiceSettings, listen: Listen, *, dev: bool = False) -> None:
    """Refuse, before anything starts, what cannot work."""
    if listen.workers < 1 or listen.workers > 64:
        raise InvalidInput(f"--workers must be from 1 to 64, not {listen.workers}")
    if not 0 <= listen.port <= 65535:
        raise InvalidInput(f"--port must be from 0 to 65535, not {listen.port}")
    if not settings.api_tokens and not listen.insecure and not is_loopback(listen.host):
        raise InvalidInput(
            f"--host {listen.host} is not a loopback address, and no token is set: anyone who "
            "reaches the port could read and change every instance. Set FLOWLOCK_API_TOKEN "
            "(name:secret:scope, scope read, write or admin), or listen on 127.0.0.1, or pass "
            "--insecure (FLOWLOCK_INSECURE=true) when something in front of the service "
            "controls who reaches it"
        )
    # With dev, the database is the embedded PostgreSQL started below, not the URL given yet.
    if listen.workers > 1 and not dev and settings.database_url.startswith(_ONE_PROCESS):
        raise InvalidInput(
            f"{settings.database_url.split(':')[0]} keeps its data in one process; with "
            f"--workers {listen.workers} each worker would see its own. Use PostgreSQL "
            "(--database-url postgresql://...) or --dev, or run one worker"
        )


@contextlib.contextmanager
def _dev_servers(settings: ServiceSettings) -> Iterator[ServiceSettings]:
    """An embedded PostgreSQL, and Redis when one starts, for `--dev`; stopped on exit."""
    from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis

    with contextlib.ExitStack() as stack:
        pg = EmbeddedPostgres()
        pg.start()
        stack.callback(pg.stop)
        redis_url = settings.redis_url
        if redis_url is None and EmbeddedRedis.find_executable() is not None:
            redis = EmbeddedRedis()
            redis.start()
            stack.callback(redis.stop)
            redis_url = redis.url
        yield dataclasses.replace(settings, database_url=pg.url, redis_url=redis_url)


@contextlib.contextmanager
def _metrics_dir(settings: ServiceSettings, workers: int) -> Iterator[ServiceSettings]:
    if workers == 1 or settings.metrics_dir is not None:
        yield settings
        return
    path = tempfile.mkdtemp(prefix="flowlock-metrics-")
    try:
        yield dataclasses.replace(settings, metrics_dir=path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Stopped(Exception):
    """SIGTERM reached the command itself (not uvicorn's handler)."""


def _stopped(signum: int, frame: object) -> None:
    raise _Stopped


def _preflight(settings: ServiceSettings) -> None:
    """Open the engine once here, as every worker will, then close it.

    An unreachable database or a refused workflow then fails the command with one error line
    and a non-zero status. Otherwise uvicorn's supervisor exits 0 when a worker fails, and
    each worker prints the same traceback.
    """
    from flowlock.service.app import create_app

    # Timers and outbox off: this engine only proves the workers can open theirs; it must not
    # claim and fire timers, or deliver messages, in the moment it is open.
    app = create_app(dataclasses.replace(settings, timers=False, outbox=False))

    async def open_and_close() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(open_and_close())


def serve(settings: ServiceSettings, listen: Listen, *, dev: bool = False) -> None:
    """Run the service until SIGTERM or Ctrl-C, then clean up and return."""
    check(settings, listen, dev=dev)
    # With one worker, uvicorn drains on SIGTERM, then raises the signal again under the handler it
    # found. The default handler would kill this process before the clean-up below, leaving --dev's
    # PostgreSQL running. This handler ends the run instead, and the command exits 0. With several
    # workers, uvicorn's supervisor handles SIGTERM itself.
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        _serve(settings, listen, dev)
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(settings: ServiceSettings, listen: Listen, dev: bool) -> None:
    import uvicorn

    with contextlib.ExitStack() as stack:
        if dev:
            settings = stack.enter_context(_dev_servers(settings))
        # Before the metrics directory is set: this process records no metrics of its own.
        _preflight(settings)
        settings = stack.enter_context(_metrics_dir(settings, listen.workers))
        os.environ.update(settings.to_env())
        uvicorn.run(
            "flowlock.service.app:app_from_env",
            factory=True,
            host=listen.host,
            port=listen.port,
            workers=listen.workers,
            log_level=listen.log_level,
            timeout_graceful_shutdown=max(1, round(settings.drain_timeout)),
            # The workers' clients wait on us, not the other way round: no proxy headers.
            proxy_headers=False,
            server_header=False,
        )
