"""How `flowlock serve` is configured: flags, or the `FLOWLOCK_*` variables named here.

Each worker is a fresh process, so settings travel as variables:
[`ServiceSettings.to_env`][flowlock.service.settings.ServiceSettings.to_env] writes them and
[`ServiceSettings.from_env`][flowlock.service.settings.ServiceSettings.from_env] reads them back.
Bad values raise [`flowlock.InvalidInput`][flowlock.InvalidInput] naming the variable.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from flowlock.core.errors import InvalidInput
from flowlock.core.settings import check_count, check_seconds, check_text

__all__ = [
    "DEFAULT_SCOPE",
    "ENV",
    "SCOPES",
    "ApiToken",
    "ServiceSettings",
    "parse_tokens",
    "scope_allows",
]

ENV = {
    "database_url": "FLOWLOCK_DATABASE_URL",
    "redis_url": "FLOWLOCK_REDIS_URL",
    "app": "FLOWLOCK_APP",
    "api_tokens": "FLOWLOCK_API_TOKEN",
    "open_metrics": "FLOWLOCK_OPEN_METRICS",
    "insecure": "FLOWLOCK_INSECURE",
    "require_if_match": "FLOWLOCK_REQUIRE_IF_MATCH",
    "max_body_bytes": "FLOWLOCK_MAX_BODY_BYTES",
    "max_json_depth": "FLOWLOCK_MAX_JSON_DEPTH",
    "pool_size": "FLOWLOCK_POOL_SIZE",
    "strategy": "FLOWLOCK_STRATEGY",
    "schema": "FLOWLOCK_SCHEMA",
    "drain_timeout": "FLOWLOCK_DRAIN_TIMEOUT",
    "timers": "FLOWLOCK_TIMERS",
    "outbox": "FLOWLOCK_OUTBOX",
    "metrics_dir": "PROMETHEUS_MULTIPROC_DIR",
}
"""The variable behind each setting (also the `envvar` of each `flowlock serve` flag)."""

DEFAULT_MAX_BODY = 1_048_576
DEFAULT_MAX_DEPTH = 32
DEFAULT_DRAIN = 10.0
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_FLAGS = ("require_if_match", "timers", "outbox", "open_metrics", "insecure")


SCOPES = ("read", "write", "admin")
"""What a token may do, each scope including the ones before it: `read` reads, `write` also
creates and fires, `admin` also repairs (force, pause, resume, workflow pauses, bulk)."""
DEFAULT_SCOPE = "write"
"""The scope of a token given without one (`name:secret`, `secret`): what such a token could do
before tokens had scopes."""


@dataclass(frozen=True, slots=True)
class ApiToken:
    """One accepted bearer token, the principal it authenticates and what it may do.

    `name:secret:scope` authenticates as `name` with `scope` (read, write or admin).
    `name:secret` has scope `write`. A bare `secret` authenticates as `token-` plus the first
    8 hex digits of its SHA-256, which reveals nothing.
    """

    principal: str
    secret: bytes = dataclasses.field(repr=False)
    scope: str = DEFAULT_SCOPE

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise InvalidInput(
                f"the token of {self.principal!r} has scope {self.scope!r}; a scope is one of "
                f"{', '.join(SCOPES)}"
            )

    def allows(self, needed: str) -> bool:
        """Whether this token's scope includes `needed` (read < write < admin)."""
        return scope_allows(self.scope, needed)


def scope_allows(have: str, needed: str) -> bool:
    """Whether the scope `have` includes `needed` (read < write < admin); an unknown `have`
    allows nothing."""
    return have in SCOPES and SCOPES.index(have) >= SCOPES.index(needed)


def _scoped(item: str) -> tuple[str, str, str]:
    """`item` as (name, secret, scope): the scope is the last ':' part when it names one."""
    head, sep, last = item.rpartition(":")
    if sep and last in SCOPES and ":" in head:
        name, _, secret = head.partition(":")
        return name, secret, last
    name, sep, secret = item.partition(":")
    if not sep:
        return "token-" + hashlib.sha256(item.encode()).hexdigest()[:8], item, DEFAULT_SCOPE
    return name, secret, DEFAULT_SCOPE


def parse_tokens(text: str) -> tuple[ApiToken, ...]:
    """The tokens of `FLOWLOCK_API_TOKEN`: comma-separated `name:secret:scope`, `name:secret`
    (scope write) or `secret`."""
    tokens = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, secret, scope = _scoped(item)
        if not name or not secret:
            raise InvalidInput(
                f"{ENV['api_tokens']}: an entry is empty on one side of ':'; give "
                "'name:secret:scope' (scope: read, write or admin), 'name:secret' or 'secret', "
                "several separated by commas"
            )
        if len(secret) < 16:
            raise InvalidInput(
                f"{ENV['api_tokens']}: the token of {name!r} is {len(secret)} characters long; "
                "use at least 16 random characters (e.g. `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'`)"
            )
        check_text(f"{ENV['api_tokens']} principal", name, most=200)
        tokens.append(ApiToken(name, secret.encode(), scope))
    return tuple(tokens)


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """What one `flowlock serve` worker runs with.

    - `database_url`: `postgresql://`, `sqlite:///path` (one worker) or `memory://`
      (tests; one worker).
    - `redis_url`: Redis for the "distributed" strategy; optional.
    - `app`: `module:attr` naming the workflows: a Workflow, a list, or a function
      returning them. None serves the examples (approval, countersign, inventory).
    - `api_tokens`: bearer tokens. When any is set, every request but `/livez` and
      `/readyz` needs one whose scope covers it: read for GET and HEAD, write for the other
      methods, admin for every path under `/admin/`. The console (`/ui`) checks its own
      session instead.
    - `open_metrics`: with tokens set, still answer `/metrics` without one (for a scraper
      that sends none).
    - `insecure`: without tokens, answer requests whatever host they are addressed to. By
      default a service without tokens answers only requests whose Host header is a loopback
      name or address (localhost, 127.0.0.1, [::1]), so a web page cannot reach it through
      DNS rebinding. With tokens set it changes nothing.
    - `require_if_match`: refuse a fire without `If-Match` (428).
    - `max_body_bytes`: refuse a larger body (413) before reading it.
    - `max_json_depth`: refuse deeper JSON (400).
    - `pool_size`: PostgreSQL connections per worker; None is the engine's default, 20.
    - `strategy`: the engine's default strategy.
    - `schema`: the PostgreSQL schema of flowlock's tables; None is the search path's first.
    - `drain_timeout`: seconds SIGTERM waits for calls in flight before closing.
    - `timers`: run the engine's timer service (fire due timers); False takes calls only
      (timers still arm, and another engine fires them).
    - `outbox`: run the engine's outbox dispatcher when handlers are registered; False takes
      calls only (messages are still written, and another engine delivers them).
    - `metrics_dir`: where workers share Prometheus metrics. `flowlock serve` sets it for
      several workers.
    """

    database_url: str = "memory://"
    redis_url: str | None = None
    app: str | None = None
    api_tokens: tuple[ApiToken, ...] = ()
    open_metrics: bool = False
    insecure: bool = False
    require_if_match: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_json_depth: int = DEFAULT_MAX_DEPTH
    pool_size: int | None = None
    strategy: str = "optimistic"
    schema: str | None = None
    drain_timeout: float = DEFAULT_DRAIN
    timers: bool = True
    outbox: bool = True
    metrics_dir: str | None = None

    def __post_init__(self) -> None:
        check_count("max_body_bytes", self.max_body_bytes, least=2, most=1 << 30, unit="bytes")
        check_count("max_json_depth", self.max_json_depth, least=2, most=500, unit="levels")
        if self.pool_size is not None:
            check_count("pool_size", self.pool_size, least=1, most=1000, unit="connections")
        check_seconds("drain_timeout", self.drain_timeout)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ServiceSettings:
        """The settings the `FLOWLOCK_*` variables of `environ` give (defaults for the rest)."""
        got: dict[str, object] = {}
        for field, var in ENV.items():
            raw = environ.get(var)
            if raw is None or (raw == "" and field != "require_if_match"):
                continue
            got[field] = _parse(field, var, raw)
            try:
                # Each value is checked alone, so an out-of-range value is refused naming its
                # variable. The bounds in __post_init__ name the field instead.
                cls(**{field: got[field]})  # type: ignore[arg-type]
            except InvalidInput as exc:
                raise InvalidInput(f"{var}={raw!r}: {exc}") from None
        return cls(**got)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """These settings as the variables
        [`from_env`][flowlock.service.settings.ServiceSettings.from_env] reads."""
        env: dict[str, str] = {}
        for field, var in ENV.items():
            value = getattr(self, field)
            if value is None:
                continue
            if field == "api_tokens":
                # The scope always written out: a worker must not read an admin token as write.
                env[var] = ",".join(f"{t.principal}:{t.secret.decode()}:{t.scope}" for t in value)
            elif isinstance(value, bool):
                env[var] = "true" if value else "false"
            else:
                env[var] = str(value)
        return env


def _parse(field: str, var: str, raw: str) -> object:
    if field == "api_tokens":
        return parse_tokens(raw)
    if field in _FLAGS:
        word = raw.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise InvalidInput(f"{var}={raw!r}: use true or false")
    if field in ("max_body_bytes", "max_json_depth", "pool_size"):
        try:
            return int(raw)
        except ValueError:
            raise InvalidInput(f"{var}={raw!r} is not a whole number") from None
    if field == "drain_timeout":
        try:
            return float(raw)
        except ValueError:
            raise InvalidInput(f"{var}={raw!r} is not a number of seconds") from None
    return raw
