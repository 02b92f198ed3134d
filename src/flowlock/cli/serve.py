"""`flowlock serve`: flowlock as an HTTP service."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from flowlock.cli._common import ENV_DATABASE_URL, ENV_REDIS_URL, app, errors_as_exit, need

__all__ = ["serve"]


def _opt(flag: str, var: str, text: str) -> Any:
    return typer.Option(flag, envvar=var, help=f"{text} [env: {var}]", show_envvar=False)


@app.command()
def serve(
    database_url: Annotated[
        str | None,
        _opt(
            "--database-url",
            ENV_DATABASE_URL,
            "PostgreSQL URL (postgresql://user@host/db); sqlite:///path or memory:// for one "
            "worker. Required unless --dev.",
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        _opt("--redis-url", ENV_REDIS_URL, "Redis URL for the 'distributed' strategy."),
    ] = None,
    app_ref: Annotated[
        str | None,
        _opt(
            "--app",
            "FLOWLOCK_APP",
            "module:attr naming the workflows to serve (a Workflow, a list, or a function "
            "returning them). Default: the examples approval, countersign, inventory.",
        ),
    ] = None,
    host: Annotated[
        str,
        _opt(
            "--host",
            "FLOWLOCK_HOST",
            "Address to listen on. Without FLOWLOCK_API_TOKEN only a loopback address "
            "(127.0.0.0/8, ::1, localhost) unless --insecure.",
        ),
    ] = "127.0.0.1",
    port: Annotated[int, _opt("--port", "FLOWLOCK_PORT", "Port to listen on.")] = 8000,
    workers: Annotated[
        int, _opt("--workers", "FLOWLOCK_WORKERS", "Worker processes (PostgreSQL only above 1).")
    ] = 1,
    require_if_match: Annotated[
        bool,
        _opt(
            "--require-if-match",
            "FLOWLOCK_REQUIRE_IF_MATCH",
            "Refuse an event without If-Match (428).",
        ),
    ] = False,
    max_body_bytes: Annotated[
        int, _opt("--max-body-bytes", "FLOWLOCK_MAX_BODY_BYTES", "Larger bodies get 413.")
    ] = 1_048_576,
    max_json_depth: Annotated[
        int, _opt("--max-json-depth", "FLOWLOCK_MAX_JSON_DEPTH", "Deeper JSON gets 400.")
    ] = 32,
    pool_size: Annotated[
        int | None,
        _opt("--pool-size", "FLOWLOCK_POOL_SIZE", "PostgreSQL connections per worker (20)."),
    ] = None,
    default_strategy: Annotated[
        str, _opt("--strategy", "FLOWLOCK_STRATEGY", "The default concurrency strategy.")
    ] = "optimistic",
    schema: Annotated[
        str | None,
        _opt("--schema", "FLOWLOCK_SCHEMA", "PostgreSQL schema of flowlock's tables."),
    ] = None,
    drain_timeout: Annotated[
        float,
        _opt(
            "--drain-timeout",
            "FLOWLOCK_DRAIN_TIMEOUT",
            "Seconds SIGTERM waits for requests in flight.",
        ),
    ] = 10.0,
    timers: Annotated[
        bool,
        _opt(
            "--timers/--no-timers",
            "FLOWLOCK_TIMERS",
            "Fire due timers in this service (the default). --no-timers takes calls only: "
            "timers still arm, and another engine (a service or worker with timers on) fires "
            "them.",
        ),
    ] = True,
    outbox: Annotated[
        bool,
        _opt(
            "--outbox/--no-outbox",
            "FLOWLOCK_OUTBOX",
            "Let this service's engines deliver outbox messages (the default), to the "
            "handlers registered on them (--app registers none). --no-outbox delivers none "
            "(outbox=False): messages are still written with their transitions, and engines "
            "with handlers (your workers) deliver them.",
        ),
    ] = True,
    open_metrics: Annotated[
        bool,
        _opt(
            "--open-metrics",
            "FLOWLOCK_OPEN_METRICS",
            "With tokens set, still answer /metrics without one (for a scraper that sends none).",
        ),
    ] = False,
    insecure: Annotated[
        bool,
        _opt(
            "--insecure",
            "FLOWLOCK_INSECURE",
            "Listen on a --host that is not loopback although no token is set, and answer "
            "requests addressed to any host name (without it, a service without tokens "
            "refuses a Host header that is not loopback: DNS rebinding): only when something "
            "in front of the service controls who reaches it.",
        ),
    ] = False,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Without --database-url: run on an embedded PostgreSQL (and Redis) started "
            "and removed with the service.",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level.")] = "info",
) -> None:
    """Run flowlock as an HTTP service (FastAPI on uvicorn).

    It serves definitions, instances, events (with If-Match and Idempotency-Key), history,
    armed timers, outbox messages, /livez, /readyz and /metrics, and fires due timers
    (unless --no-timers).
    OpenAPI is at /openapi.json, docs at /docs.

    **FLOWLOCK_API_TOKEN** holds bearer tokens, comma-separated, each a name, a secret and a
    scope (read, write or admin) joined by colons, such as `ops:<secret>:admin`; one without a
    scope (`name:<secret>`, or a bare secret) is write. When set, every
    request but /livez and /readyz needs one: GET and HEAD need read, other methods write,
    paths under /admin/ admin; /metrics too unless --open-metrics. The name becomes the actor of
    its calls. It is read from the environment only, never a flag: argv is visible to every user.

    **Without a token** the service listens on loopback only (127.0.0.0/8, ::1, localhost):
    another --host is refused unless --insecure. It also answers only requests addressed to a
    loopback name (their Host header), so a web page cannot reach it by DNS rebinding.

    SIGTERM drains the requests in flight (--drain-timeout) and releases connections and leases.
    """
    need("service", "flowlock serve", "fastapi", "uvicorn")
    from flowlock.service.server import Listen
    from flowlock.service.server import serve as run
    from flowlock.service.settings import ENV, ServiceSettings

    if database_url is None and not dev:
        raise typer.BadParameter(
            f"give --database-url (or {ENV_DATABASE_URL}), or --dev for an embedded PostgreSQL"
        )
    with errors_as_exit():
        tokens = ServiceSettings.from_env(
            {ENV["api_tokens"]: os.environ.get(ENV["api_tokens"], "")}
        ).api_tokens
        settings = ServiceSettings(
            database_url=database_url or "memory://",
            redis_url=redis_url,
            app=app_ref,
            api_tokens=tokens,
            open_metrics=open_metrics,
            insecure=insecure,
            require_if_match=require_if_match,
            max_body_bytes=max_body_bytes,
            max_json_depth=max_json_depth,
            pool_size=pool_size,
            strategy=default_strategy,
            schema=schema,
            drain_timeout=drain_timeout,
            timers=timers,
            outbox=outbox,
        )
        if app_ref is not None:
            from flowlock.core.diagram import load_workflows

            load_workflows(app_ref)  # a bad reference fails here, not in every worker
        listen = Listen(host, port, workers, log_level, insecure=insecure)
        run(settings, listen, dev=dev and database_url is None)
