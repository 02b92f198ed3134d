"""The benchmark runner: measures, checks and returns dataclasses; it renders nothing.

For each (scenario, strategy) pair the runner opens a fresh engine (so one strategy's warm pool or
state never helps the next), runs one untimed warm-up round, then the timed rounds. In a round
every caller task is created first and parked on a gate; once all of them wait, the gate opens and
each call is timed from that release to its completion, which is what a caller of a stormed
instance experiences (the seed's "100 threads at once"). Between rounds nothing is timed.

While the timed rounds run, a separate plain connection samples ``pg_stat_activity`` every ~20 ms
for the peak number of flowlock connections. After them, every instance's final state and history
is read back and judged by :func:`flowlock.checker.check` plus the scenario's own rules.

The database is an embedded PostgreSQL started for the run (the default), or the caller's server,
where all tables live in a scratch schema ``flowlock_bench_<hex>`` dropped at the end. Both are
cleaned up in ``finally`` blocks, so an error or Ctrl-C leaves no server and no schema behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg

import flowlock
from flowlock.bench.scenarios import (
    SCENARIOS,
    CallResult,
    CallSpec,
    Judgement,
    Kind,
    RoundRecord,
    Scenario,
)
from flowlock.checker import Verdict, Violation, check
from flowlock.engine import Engine
from flowlock.errors import (
    InvalidInput,
    StoreError,
    TransitionRefused,
)
from flowlock.models import HistoryEntry, Instance
from flowlock.strategies.base import Strategy
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "BenchConfig",
    "BenchReport",
    "NullProgress",
    "Progress",
    "ScenarioResult",
    "StrategySpec",
    "register_strategy",
    "run",
    "run_bench",
]

SAMPLE_INTERVAL = 0.02
"""Seconds between two pg_stat_activity samples (the peak-connections probe)."""

QUICK_ROUNDS = 2
"""Rounds per scenario under ``quick`` (keeps a full default run well under 30 s)."""

# Connections the run needs beyond the engine's pool: the sampler, the one-off connection a store
# opens to create its schema, and a little slack for backends that are still exiting after the
# previous pair's pool closed.
_CONNECTION_HEADROOM = 4
_EMBEDDED_MIN_CONNECTIONS = 300
_APPLICATION_NAME = "flowlock"  # what PostgresStore sets on its pool connections
_OWN_APPLICATION_NAME = "flowlock-bench"  # the sampler must not count itself


# -- strategies --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """A concurrency strategy the benchmark can run: ``build`` makes a fresh instance with the
    given random source (seeded per run, so jitter is reproducible with ``--seed``)."""

    name: str
    summary: str
    build: Callable[[random.Random], Strategy]


STRATEGIES: dict[str, StrategySpec] = {}
"""Every strategy the benchmark knows, by name."""

DEFAULT_STRATEGIES: tuple[str, ...] = ("optimistic", "pessimistic")
"""What ``flowlock bench`` runs when no ``--strategy`` is given."""


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` to :data:`STRATEGIES` (replacing one of the same name)."""
    STRATEGIES[spec.name] = spec
    return spec


register_strategy(
    StrategySpec(
        "optimistic",
        "version compare-and-swap, 3 attempts, jittered backoff",
        lambda rng: Optimistic(rng=rng),
    )
)
register_strategy(
    StrategySpec(
        "pessimistic",
        "row lock (SELECT ... FOR UPDATE) with a 5 s lock_timeout",
        lambda rng: Pessimistic(),
    )
)


# -- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to run. ``None`` means "the default": every scenario, the default strategies, each
    scenario's own number of rounds (2 under ``quick``), a pool of ``workers`` connections (one
    per caller, like the seed's experiment; lowered to what the server can take), an embedded
    PostgreSQL, and a random seed (reported, so the run can be repeated)."""

    scenarios: tuple[str, ...] | None = None
    strategies: tuple[str, ...] | None = None
    workers: int = 100
    rounds: int | None = None
    quick: bool = False
    seed: int | None = None
    pool_size: int | None = None
    database_url: str | None = None
    warmup: bool = True

    def validate(self) -> None:
        """Raise InvalidInput for anything that cannot run; does no I/O."""
        for name in self.scenario_names():
            if name not in SCENARIOS:
                raise InvalidInput(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        for name in self.strategy_names():
            if name not in STRATEGIES:
                raise InvalidInput(
                    f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}"
                )
        if not self.scenario_names() or not self.strategy_names():
            raise InvalidInput("choose at least one scenario and one strategy")
        if self.workers < 1:
            raise InvalidInput(f"workers must be at least 1, not {self.workers}")
        if self.rounds is not None and self.rounds < 1:
            raise InvalidInput(f"rounds must be at least 1, not {self.rounds}")
        if self.pool_size is not None and self.pool_size < 1:
            raise InvalidInput(f"pool_size must be at least 1, not {self.pool_size}")
        if self.database_url is not None:
            scheme = self.database_url.partition("://")[0].lower()
            if scheme == "sqlite":
                raise InvalidInput(
                    "the benchmark needs PostgreSQL (it measures row locks and connections); "
                    "give a postgresql:// URL, or no URL to use an embedded server"
                )
            if scheme not in ("postgresql", "postgres"):
                raise InvalidInput(
                    f"unsupported database url {redact(self.database_url)!r}: "
                    "use postgresql://user@host/db"
                )

    def scenario_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.scenarios)) if self.scenarios else tuple(SCENARIOS)

    def strategy_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.strategies)) if self.strategies else DEFAULT_STRATEGIES

    def rounds_for(self, scenario: Scenario) -> int:
        if self.rounds is not None:
            return self.rounds
        return QUICK_ROUNDS if self.quick else scenario.default_rounds


# -- results -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    """The measurements and the verdict of one (scenario, strategy) pair's timed rounds.

    Latencies in milliseconds; ``success_pct`` counts calls that applied, were answered
    idempotently, or were refused by a business rule (not lock or conflict failures).
    """

    scenario: str
    strategy: str
    workers: int
    rounds: int
    calls: int
    avg_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    success_pct: float
    attempts_per_call: float
    calls_per_s: float
    applied_per_s: float
    peak_connections: int
    peak_active_connections: int
    double_advanced_rounds: int
    applied: int
    idempotent: int
    refused: int
    failed: int
    applied_per_round: tuple[int, ...]
    errors: Mapping[str, int]
    wall_s: float
    loop: str
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class BenchReport:
    """A whole run: the environment, the arguments, and one result per pair."""

    flowlock_version: str
    postgres_version: str
    redis_version: str | None
    cores: int
    args: Mapping[str, Any]
    results: tuple[ScenarioResult, ...]
    loop: str
    database: str
    """``"embedded"`` or ``"external"``."""
    pool_size: int
    duration_s: float
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every pair's checker verdict is ok."""
        return all(r.verdict.ok for r in self.results)


# -- progress ----------------------------------------------------------------------------------


class Progress(Protocol):
    """Told what the runner is doing, so a front end can show it. Must not block."""

    def status(self, message: str) -> None:
        """A step outside the measured rounds (starting a server, connecting...)."""

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        """A pair starts; ``rounds`` counts the warm-up round too."""

    def advance(self) -> None:
        """One round of the current pair finished."""

    def end(self) -> None:
        """The current pair finished."""


class NullProgress:
    """Progress that shows nothing."""

    def status(self, message: str) -> None:
        pass

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        pass

    def advance(self) -> None:
        pass

    def end(self) -> None:
        pass


# -- helpers -----------------------------------------------------------------------------------


def redact(url: str) -> str:
    """``url`` without its password, for reports and messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rpartition("@")
        user = netloc[0].partition(":")[0]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
    except ValueError:
        return "<unparseable url>"


def cores() -> int:
    """CPUs this process may run on (not the machine's count, under a container limit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the event loop running now."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 for an empty one)."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _store_error(exc: BaseException, url: str, what: str) -> StoreError:
    # The runner's own plain connections (probe, sampler, schema drop) are a driver edge too:
    # translate here so the CLI shows one line, never an asyncpg traceback.
    return StoreError(f"{what} on PostgreSQL at {redact(url).split('@')[-1]!r}: {exc}")


_DRIVER_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


async def _connect(url: str) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(
            url, timeout=10, server_settings={"application_name": _OWN_APPLICATION_NAME}
        )
    except _DRIVER_ERRORS as exc:
        raise _store_error(exc, url, "cannot connect") from exc


# -- the server ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Server:
    url: str
    kind: str
    version: str = ""
    pool_size: int = 0
    notes: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def _server(config: BenchConfig, progress: Progress) -> AsyncIterator[_Server]:
    """The database to run against: the caller's, or an embedded one stopped on the way out."""
    if config.database_url is not None:
        progress.status(f"connecting to {redact(config.database_url).split('@')[-1]}")
        yield _Server(config.database_url, "external")
        return
    from flowlock.embedded import EmbeddedPostgres

    wanted = (config.pool_size or config.workers) + _CONNECTION_HEADROOM + 10
    progress.status("starting an embedded PostgreSQL")
    pg = EmbeddedPostgres(max_connections=max(_EMBEDDED_MIN_CONNECTIONS, wanted))
    # 为什么 try/finally around async with: __aexit__ stops the server on errors and on the
    # cancellation Ctrl-C causes; the extra stop() covers a cancel that lands in __aenter__
    # after the server came up (stop() is idempotent).
    try:
        async with pg:
            yield _Server(pg.url, "embedded")
            progress.status("stopping the embedded PostgreSQL")
    finally:
        await asyncio.to_thread(pg.stop)


async def _probe(server: _Server, config: BenchConfig) -> None:
    """Read the server version and size the pool to what the server can still accept."""
    conn = await _connect(server.url)
    try:
        # server_version, e.g. "15.20 (Debian 15.20-0+deb12u1)": asyncpg's parsed
        # ServerVersion reads "15.20" as 15.0.20, so take the server's own first word.
        shown = await conn.fetchval("SELECT current_setting('server_version')")
        server.version = str(shown).split()[0]
        row = await conn.fetchrow(
            """
            SELECT current_setting('max_connections')::int AS max_conn,
                   current_setting('superuser_reserved_connections')::int AS su_reserved,
                   coalesce(current_setting('reserved_connections', true), '0')::int AS reserved,
                   (SELECT count(*) FROM pg_stat_activity
                     WHERE backend_type = 'client backend')::int AS used,
                   (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser
            """
        )
    except _DRIVER_ERRORS as exc:
        raise _store_error(exc, server.url, "cannot inspect the server") from exc
    finally:
        await conn.close()
    assert row is not None
    reserved = 0 if row["superuser"] else row["su_reserved"] + row["reserved"]
    # ``used`` includes this probe connection, which is closed again; the sampler replaces it.
    free = row["max_conn"] - reserved - row["used"] - _CONNECTION_HEADROOM
    wanted = config.pool_size or config.workers
    if wanted <= free:
        server.pool_size = wanted
        return
    if config.pool_size is not None or free < 1:
        raise InvalidInput(
            f"the server accepts about {max(free, 0)} more connections "
            f"(max_connections={row['max_conn']}, {row['used']} in use), not a pool of "
            f"{wanted}; lower --pool-size or raise max_connections"
        )
    server.pool_size = free
    server.notes.append(
        f"pool lowered from {wanted} to {free} connections: the server allows "
        f"max_connections={row['max_conn']} and {row['used']} are in use; "
        f"{config.workers - free} callers wait for a pooled connection"
    )


async def _drop_schema(url: str, schema: str) -> None:
    conn = await _connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    except _DRIVER_ERRORS as exc:
        raise _store_error(exc, url, f"cannot drop the scratch schema {schema!r}") from exc
    finally:
        await conn.close()


# -- measurement -------------------------------------------------------------------------------


class _Sampler:
    """Peak flowlock connections (all, and those not idle) while the block runs."""

    _QUERY = """
        SELECT count(*)::int AS total, count(*) FILTER (WHERE state <> 'idle')::int AS active
          FROM pg_stat_activity
         WHERE application_name = $1 AND datname = current_database()
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.peak = 0
        self.peak_active = 0

    async def __aenter__(self) -> _Sampler:
        conn = await _connect(self._url)
        self._task = asyncio.create_task(self._run(conn))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self, conn: asyncpg.Connection) -> None:
        try:
            while True:
                row = await conn.fetchrow(self._QUERY, _APPLICATION_NAME)
                if row is not None:
                    self.peak = max(self.peak, row["total"])
                    self.peak_active = max(self.peak_active, row["active"])
                # Sleeping on the stop event (not a plain sleep) ends the sampler at once and
                # never between a query and its answer, so the connection closes cleanly.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), SAMPLE_INTERVAL)
                if self._stop.is_set():
                    return
        except _DRIVER_ERRORS as exc:
            raise _store_error(exc, self._url, "the connection sampler failed") from exc
        finally:
            with contextlib.suppress(*_DRIVER_ERRORS):
                await conn.close(timeout=2)


class _Gate:
    """Parks every caller until all have arrived, then releases them at one instant."""

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._arrived = 0
        self._all_here = asyncio.Event()
        self._open = asyncio.Event()
        self.released_at = 0.0
        if parties == 0:
            self._all_here.set()

    async def wait(self) -> None:
        self._arrived += 1
        if self._arrived == self._parties:
            self._all_here.set()
        await self._open.wait()

    async def release(self) -> float:
        await self._all_here.wait()
        self.released_at = time.perf_counter()
        self._open.set()
        return self.released_at


async def _call(engine: Engine, spec: CallSpec, strategy: str, gate: _Gate) -> CallResult:
    await gate.wait()
    try:
        out = await engine.fire(
            spec.instance_id,
            spec.event,
            actor=spec.actor,
            payload=spec.payload,
            request_id=spec.request_id,
            strategy=strategy,
        )
    except TransitionRefused as exc:
        return CallResult(
            spec, "refused", time.perf_counter() - gate.released_at, 1, type(exc).__name__, str(exc)
        )
    except Exception as exc:
        # Any failure is a measurement, not a crash of the benchmark: FlowlockErrors are the
        # expected ones (conflicts, lock timeouts); anything else would be an engine bug, and the
        # report shows it by its type.
        attempts = getattr(exc, "attempts", 1)
        return CallResult(
            spec,
            "failed",
            time.perf_counter() - gate.released_at,
            attempts if isinstance(attempts, int) and attempts > 0 else 1,
            type(exc).__name__,
            str(exc),
        )
    kind: Kind = "applied" if out.applied else "idempotent"
    return CallResult(spec, kind, time.perf_counter() - gate.released_at, out.attempts)


async def _round(
    engine: Engine, scenario: Scenario, strategy: str, key: str, workers: int
) -> tuple[RoundRecord, float]:
    """One released round; returns its record and its wall time (release to last completion)."""
    plan = await scenario.setup(engine, key, workers)
    gate = _Gate(len(plan.calls))
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(_call(engine, spec, strategy, gate)) for spec in plan.calls]
        await gate.release()
    results = tuple(t.result() for t in tasks)
    wall = max((r.latency for r in results), default=0.0)
    finals: dict[str, Instance] = {}
    histories: dict[str, list[HistoryEntry]] = {}
    for iid in plan.instances:
        finals[iid] = await engine.get(iid)
        histories[iid] = await engine.history(iid)
    return RoundRecord(plan, results, finals, histories), wall


def _verdict(
    scenario: Scenario,
    records: Sequence[RoundRecord],
    judgements: Sequence[Judgement],
    workers: int,
) -> Verdict:
    """The generic exactly-once check of every instance, plus the scenario's own rules."""
    found: list[Violation] = []
    invariant = scenario.invariant(workers)
    for record, judgement in zip(records, judgements, strict=True):
        applied = record.applied_by_instance()
        for iid, initial in record.plan.instances.items():
            found.extend(
                check(
                    record.finals[iid],
                    record.histories[iid],
                    initial_state=initial,
                    expected_applied=applied[iid],
                    invariant=invariant,
                ).violations
            )
        found.extend(judgement.violations)
    return Verdict.of(found)


def _summarise(
    scenario: Scenario,
    strategy: str,
    workers: int,
    records: Sequence[RoundRecord],
    wall: float,
    sampler: _Sampler,
    loop: str,
) -> ScenarioResult:
    results = [r for record in records for r in record.results]
    judgements = [scenario.judge(record, workers) for record in records]
    errors = Counter(r.error for r in results if r.kind == "failed" and r.error)
    kinds = Counter(r.kind for r in results)
    latencies = sorted(r.latency * 1000 for r in results)
    calls = len(results)
    ok = kinds["applied"] + kinds["idempotent"] + kinds["refused"]
    return ScenarioResult(
        scenario=scenario.name,
        strategy=strategy,
        workers=workers,
        rounds=len(records),
        calls=calls,
        avg_ms=sum(latencies) / calls if calls else 0.0,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=latencies[-1] if latencies else 0.0,
        success_pct=100.0 * ok / calls if calls else 0.0,
        attempts_per_call=sum(r.attempts for r in results) / calls if calls else 0.0,
        calls_per_s=calls / wall if wall > 0 else 0.0,
        applied_per_s=kinds["applied"] / wall if wall > 0 else 0.0,
        peak_connections=sampler.peak,
        peak_active_connections=sampler.peak_active,
        double_advanced_rounds=sum(1 for j in judgements if j.double_advanced),
        applied=kinds["applied"],
        idempotent=kinds["idempotent"],
        refused=kinds["refused"],
        failed=kinds["failed"],
        applied_per_round=tuple(sum(rec.applied_by_instance().values()) for rec in records),
        errors=dict(errors.most_common()),
        wall_s=wall,
        loop=loop,
        verdict=_verdict(scenario, records, judgements, workers),
    )


async def _run_pair(
    server: _Server,
    schema: str,
    tag: str,
    config: BenchConfig,
    seed: int,
    scenario: Scenario,
    spec: StrategySpec,
    progress: Progress,
) -> ScenarioResult:
    rounds = config.rounds_for(scenario)
    workers = config.workers
    # One random stream per pair, derived from the run's seed: reruns with --seed replay the same
    # jitter, and adding a scenario does not shift the others' streams.
    rng = random.Random(f"{seed}/{scenario.name}/{spec.name}")
    engine = Engine.connect(
        server.url,
        pool_size=server.pool_size,
        schema=schema,
        strategies={spec.name: spec.build(rng)},
    )
    progress.begin(scenario.name, spec.name, rounds + (1 if config.warmup else 0))
    async with engine:
        for wf in scenario.workflows(workers):
            await engine.register(wf)
        prefix = f"bench-{tag}-{scenario.name}-{spec.name}"
        if config.warmup:
            # Untimed: fills the pool and every connection's prepared-statement cache.
            await _round(engine, scenario, spec.name, f"{prefix}-warmup", workers)
            progress.advance()
        records: list[RoundRecord] = []
        wall = 0.0
        async with _Sampler(server.url) as sampler:
            for n in range(1, rounds + 1):
                record, took = await _round(engine, scenario, spec.name, f"{prefix}-r{n}", workers)
                records.append(record)
                wall += took
                progress.advance()
    progress.end()
    return _summarise(scenario, spec.name, workers, records, wall, sampler, loop_name())


async def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run the benchmark on the running event loop and return its report."""
    config.validate()
    shown: Progress = progress or NullProgress()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    tag = secrets.token_hex(4)
    schema = f"flowlock_bench_{secrets.token_hex(6)}"
    started = time.perf_counter()
    results: list[ScenarioResult] = []
    async with _server(config, shown) as server:
        await _probe(server, config)
        try:
            for scenario_name in config.scenario_names():
                for strategy_name in config.strategy_names():
                    results.append(
                        await _run_pair(
                            server,
                            schema,
                            tag,
                            config,
                            seed,
                            SCENARIOS[scenario_name],
                            STRATEGIES[strategy_name],
                            shown,
                        )
                    )
        finally:
            # Also on errors and Ctrl-C: the user's database keeps nothing of the run.
            shown.status(f"dropping the scratch schema {schema}")
            await _drop_schema(server.url, schema)
    args: dict[str, Any] = {
        "scenarios": list(config.scenario_names()),
        "strategies": list(config.strategy_names()),
        "workers": config.workers,
        "rounds": {n: config.rounds_for(SCENARIOS[n]) for n in config.scenario_names()},
        "quick": config.quick,
        "seed": seed,
        "pool_size": server.pool_size,
        "warmup": config.warmup,
        "database": "embedded" if config.database_url is None else redact(config.database_url),
        "schema": schema,
    }
    return BenchReport(
        flowlock_version=flowlock.__version__,
        postgres_version=server.version,
        redis_version=None,
        cores=cores(),
        args=args,
        results=tuple(results),
        loop=loop_name(),
        database=server.kind,
        pool_size=server.pool_size,
        duration_s=time.perf_counter() - started,
        notes=tuple(server.notes),
    )


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Run the benchmark on a new event loop (uvloop when installed) and return its report.

    Ctrl-C cancels the run; the embedded server is stopped and the scratch schema dropped before
    KeyboardInterrupt propagates.
    """
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(run_bench(config, progress))
