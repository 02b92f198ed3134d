"""What to run (`BenchConfig`) and where a process's sessions connect (`Target`).

Validation does no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from flowlock.bench.registry import ALIASES, DEFAULT_STRATEGIES, STRATEGIES, expand
from flowlock.bench.results import Params
from flowlock.bench.scenarios import SCENARIO_ALIASES, SCENARIOS, Scenario
from flowlock.core.errors import InvalidInput
from flowlock.core.settings import check_flag

__all__ = [
    "ADMIN_POOL",
    "ADVISORY_POOL",
    "DEFAULT_PROCESSES",
    "HOSTS_SCENARIOS",
    "HTTP_SCENARIOS",
    "HTTP_STRATEGIES",
    "HTTP_WORKERS",
    "MAX_DELAY_MS",
    "MAX_HOSTS",
    "BenchConfig",
    "Target",
    "redact",
    "service_pool",
]

DEFAULT_PROCESSES = 4
"""OS processes of the multi-process scenarios when `processes` is not given (with `hosts`,
at least one per host)."""

MAX_HOSTS = 16
"""The most namespaced hosts of one run (`--hosts`): each runs at least one worker process,
and a 2-core machine is saturated long before."""
MAX_DELAY_MS = 1000.0
"""The largest netem delay `--netem-delay` takes, in ms."""

HOSTS_SCENARIOS = ("spread", "cluster")
"""What `--hosts` runs when no scenario is named: the sustained must-apply load from every
host, on many instances (spread) and on instances the hosts share (cluster)."""

ADVISORY_POOL = 20
"""Lease connections of an advisory-lock backend, per process (its library default)."""

ADMIN_POOL = 10
"""The parent's pool while worker processes do the calls (and while the service does them,
under `--http`: this process then only sets rounds up and reads them back)."""

HTTP_SCENARIOS = ("storm", "hot", "spread")
"""What `--http` runs through the service: the scenarios whose every call is one plain
`engine.fire`, on workflows `flowlock_lab.http_app` serves."""
HTTP_STRATEGIES = ("optimistic", "pessimistic", "adaptive")
"""The strategies `--http` runs when none is given, and the only ones it can: those the
service's engine has without a lock backend of its own (`raw` has no engine at all)."""
HTTP_WORKERS = 1
"""`flowlock serve --workers` under `--http`. One: on the 2-core development machine two
workers measured the same within the noise (`--quick`, twice each: about 670 against 700
requests/s, p99 about 215 ms either way), and one worker keeps every call on one engine, so
concurrent calls on an instance batch as they do in-process (two split the storm's batches in
half)."""

_NOT_THROUGH_HTTP = {
    "countersign": "it is not wired to the service yet (its quorum is sized to the callers)",
    "inventory": "it is not wired to the service yet (its stock is sized to the callers)",
    "cluster": "it runs its callers in worker processes of its own",
    "singleton": "it runs a scheduled job, not an HTTP call",
    "deadline": "its expiries are fired by the timer services of its worker processes",
    "hot-outbox": "its messages' handler runs in the bench's own engine, not the service's",
    "capacity-spread": "its callers' retries and refusals are tallied in the bench's process",
    "capacity-storm": "its callers' retries and refusals are tallied in the bench's process",
    "capacity-wait": "its callers' refusals are tallied in the bench's process",
    "spread-outbox": "its messages' handler runs in the bench's own engine, not the service's",
}
_NO_HTTP_STRATEGY = {
    "raw": "raw is the bare-asyncpg floor: there is no engine to put behind HTTP",
    "distributed-redis": "the service would lease from Redis outside the run's scratch "
    "namespace, which the bench could not clean up",
    "distributed-advisory": "flowlock serve has no advisory-lock backend",
}


def service_pool(pool: int, workers: int) -> int:
    """PostgreSQL connections per worker of the `--http` service.

    The run's `pool` is shared out, so both transports get the same connections.
    """
    return max(1, -(-pool // workers))


def redact(url: str) -> str:
    """`url` without its password, for reports and messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rpartition("@")
        user = netloc[0].partition(":")[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
    except ValueError:
        return "<unparseable url>"


_POSTGRES_SCHEMES = ("postgresql", "postgres")
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to run; `None` means the default.

    Defaults: every scenario and strategy, and each scenario's own rounds and calls.
    `quick` lowers those counts. Multi-process scenarios use 4 processes.
    The pool has one connection per caller, as in the seed, lowered to what the server takes.
    PostgreSQL and Redis are embedded. The seed is random but reported, so a run can be repeated.
    Engines batch unless `batching` is False.
    """

    scenarios: tuple[str, ...] | None = None
    strategies: tuple[str, ...] | None = None
    workers: int = 100
    rounds: int | None = None
    ops: int | None = None
    processes: int | None = None
    quick: bool = False
    seed: int | None = None
    pool_size: int | None = None
    database_url: str | None = None
    redis_url: str | None = None
    warmup: bool = True
    """Run one untimed round per pair first (not under `quick`, whose pools are only filled
    before the first round)."""
    batching: bool = True
    """Every flowlock engine the run builds batches concurrent calls on one instance
    (`Engine(batching=...)`); the raw floor has no engine and is the same either way."""
    hosts: int | None = None
    """Run every scenario's callers in worker processes spread over this many Linux network
    namespaces (`flowlock_lab.hosts`), against an embedded PostgreSQL and Redis on the
    namespaces' bridge. Needs root and iproute2."""
    netem_delay_ms: float | None = None
    """With `hosts`: the netem delay of each direction of each host's link; None: 1 ms with
    two hosts or more where the kernel has netem, else none; 0: none."""
    http: bool = False
    """Run each pair twice: in this process, then through a `flowlock serve` subprocess
    started for the run, by `workers` concurrent HTTP callers (`flowlock_lab.http`).
    Only `HTTP_SCENARIOS` and `HTTP_STRATEGIES`; every pair warms up first, also
    under `quick`, so both transports are compared warm."""
    http_workers: int = HTTP_WORKERS
    """The service's worker processes under `http`."""

    def validate(self) -> None:
        """Raise InvalidInput for anything that cannot run; does no I/O."""
        self._check_names()
        self._check_counts()
        self._check_urls()
        check_flag("http", self.http)
        if self.http and self.hosts is not None:
            # The two measure different things and cannot share a run: --http calls a service
            # on this machine's loopback from the bench's own process, --hosts moves every
            # caller into worker processes in namespaces, which cannot reach the loopback.
            raise InvalidInput(
                "--http and --hosts cannot be combined: --http calls a flowlock serve on "
                "127.0.0.1 from the bench's own process, while --hosts runs every caller in "
                "worker processes on namespaced hosts; run them as two separate benches"
            )
        self._check_hosts()
        check_flag("batching", self.batching)
        if self.http:
            self._check_http()

    def _check_http(self) -> None:
        for name in self.scenario_names():
            if name not in HTTP_SCENARIOS:
                why = _NOT_THROUGH_HTTP.get(name, "it is not one of them")
                raise InvalidInput(
                    f"--http runs {', '.join(HTTP_SCENARIOS)} through the service; not "
                    f"{name!r}: {why}. Drop --scenario {name}, or run it without --http"
                )
        for name in self.strategy_names():
            if name not in HTTP_STRATEGIES:
                why = _NO_HTTP_STRATEGY.get(name, f"{name!r} is not one of them")
                raise InvalidInput(
                    f"--http runs the strategies {', '.join(HTTP_STRATEGIES)} through the "
                    f"service; {why}. Drop --strategy {name}, or run it without --http"
                )
        if not self.batching:
            raise InvalidInput(
                "--http compares with the service, whose engine always batches (flowlock serve "
                "has no switch for it); drop --batching off"
            )
        if not 1 <= self.http_workers <= 64:
            raise InvalidInput(
                f"http_workers (the service's worker processes) must be 1 to 64, "
                f"not {self.http_workers}"
            )

    def _check_hosts(self) -> None:
        if self.hosts is None:
            if self.netem_delay_ms is not None:
                raise InvalidInput("a netem delay needs hosts (--netem-delay needs --hosts N)")
            return
        if isinstance(self.hosts, bool) or not 1 <= self.hosts <= MAX_HOSTS:
            raise InvalidInput(f"hosts must be 1 to {MAX_HOSTS}, not {self.hosts!r}")
        delay = self.netem_delay_ms
        if delay is not None and (isinstance(delay, bool) or not 0 <= delay <= MAX_DELAY_MS):
            raise InvalidInput(f"the netem delay must be 0 to {MAX_DELAY_MS:g} ms, not {delay!r}")
        if self.database_url is not None or self.redis_url is not None:
            given = "--database-url" if self.database_url is not None else "--redis-url"
            raise InvalidInput(
                f"--hosts runs on an embedded PostgreSQL and Redis listening on the hosts' "
                f"bridge (a server on 127.0.0.1 cannot be reached from a namespace), so it "
                f"refuses {given}; drop it (or unset FLOWLOCK_DATABASE_URL / "
                "FLOWLOCK_REDIS_URL, or add --embedded)"
            )
        emitting = [n for n in self.scenario_names() if SCENARIOS[n].emits]
        if emitting:
            raise InvalidInput(
                f"--hosts runs every caller in worker processes, but {emitting[0]!r} runs in the "
                "bench's own process (its handler notes each message in that process's memory); "
                f"drop --scenario {emitting[0]}, or run it without --hosts"
            )
        tallied = [n for n in self.scenario_names() if SCENARIOS[n].tallied]
        if tallied:
            raise InvalidInput(
                f"--hosts runs every caller in worker processes, but {tallied[0]!r} tallies its "
                "callers' refusals in the bench's own process; drop --scenario "
                f"{tallied[0]}, or run it without --hosts"
            )
        if self.process_count() < self.hosts:
            raise InvalidInput(
                f"each host runs at least one worker process: {self.process_count()} "
                f"process(es) cannot cover {self.hosts} hosts; raise --processes (and "
                "--workers) to at least --hosts"
            )

    def _check_names(self) -> None:
        for name in self._named_scenarios():
            if name not in SCENARIOS:
                known = [*SCENARIOS, *SCENARIO_ALIASES]
                raise InvalidInput(f"unknown scenario {name!r}; choose from {', '.join(known)}")
        for name in self.strategy_names():
            if name not in STRATEGIES:
                known = [*STRATEGIES, *ALIASES]
                raise InvalidInput(f"unknown strategy {name!r}; choose from {', '.join(known)}")
        if not self.scenario_names() or not self.strategy_names():
            raise InvalidInput("choose at least one scenario and one strategy")

    def _check_counts(self) -> None:
        for what in ("workers", "rounds", "ops", "processes", "pool_size"):
            value = getattr(self, what)
            if value is not None and value < 1:
                raise InvalidInput(f"{what} must be at least 1, not {value}")

    def _check_urls(self) -> None:
        if self.database_url is not None:
            scheme = _scheme(self.database_url)
            if scheme == "sqlite":
                raise InvalidInput(
                    "the benchmark needs PostgreSQL (it measures row locks and connections); "
                    "give a postgresql:// URL, or no URL to use an embedded server"
                )
            if scheme not in _POSTGRES_SCHEMES:
                raise InvalidInput(
                    f"unsupported database url {redact(self.database_url)!r}: "
                    "use postgresql://user@host/db"
                )
        if self.redis_url is not None and _scheme(self.redis_url) not in _REDIS_SCHEMES:
            raise InvalidInput(
                f"unsupported redis url {redact(self.redis_url)!r}: use redis://host:6379/0"
            )

    def _named_scenarios(self) -> tuple[str, ...]:
        """The scenarios asked for, aliases expanded (`outbox`: hot, hot-outbox, spread,
        spread-outbox), each once, in first-mention order; unknown names are kept."""
        names = [n for given in self.scenarios or () for n in SCENARIO_ALIASES.get(given, (given,))]
        return tuple(dict.fromkeys(names))

    def scenario_names(self) -> tuple[str, ...]:
        if self.scenarios:
            return self._named_scenarios()
        if self.hosts is not None:
            return HOSTS_SCENARIOS
        if self.http:
            return HTTP_SCENARIOS
        return tuple(n for n, s in SCENARIOS.items() if s.full_by_default or self.quick)

    def strategy_names(self) -> tuple[str, ...]:
        if self.strategies:
            return expand(self.strategies)
        if self.http:
            return tuple(n for n in HTTP_STRATEGIES if n in STRATEGIES)
        return DEFAULT_STRATEGIES

    def rounds_for(self, scenario: Scenario) -> int:
        return self.rounds if self.rounds is not None else scenario.rounds(self.quick)

    def ops_for(self, scenario: Scenario) -> int:
        if not scenario.uses_ops:
            return 1
        return self.ops if self.ops is not None else scenario.ops(self.quick)

    def warms_up(self) -> bool:
        # Under --http always: the service's pool grows on demand and the client's connections
        # open on first use, so a cold first round would measure connecting, not the transport.
        return self.warmup and (self.http or not self.quick)

    def process_count(self) -> int:
        default = max(DEFAULT_PROCESSES, self.hosts or 0)
        return min(self.workers, self.processes or default)

    def in_processes(self, scenario: Scenario) -> bool:
        """Whether `scenario`'s callers run in the worker processes.

        Multi-process scenarios always do. With hosts, every scenario does: the workers run there.
        """
        return scenario.multiprocess or self.hosts is not None

    def params_for(self, scenario: Scenario) -> Params:
        return Params(
            workers=scenario.callers(self.workers, self.quick),
            ops=self.ops_for(scenario),
            processes=self.process_count() if self.in_processes(scenario) else 1,
        )


@dataclass(frozen=True, slots=True)
class Target:
    """Where one process's sessions connect.

    It holds the database and schema, the Redis URL and key namespace, and the pool size.
    The run's tag names every connection of the run in pg_stat_activity.
    """

    url: str
    schema: str
    namespace: str
    tag: str
    pool_size: int
    redis_url: str | None = None

    @property
    def application_name(self) -> str:
        return f"flowlock-{self.tag}"

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "schema": self.schema,
            "namespace": self.namespace,
            "tag": self.tag,
            "pool_size": self.pool_size,
            "redis_url": self.redis_url,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Target:
        return cls(
            doc["url"],
            doc["schema"],
            doc["namespace"],
            doc["tag"],
            int(doc["pool_size"]),
            doc["redis_url"],
        )
