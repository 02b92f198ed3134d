"""The soak's pure parts: how a call's end is classified, the exactly-once judgement of the
store, the report's verdict and rendering, the fault schedule, and the config's refusals."""

from __future__ import annotations

import asyncio
import io
import json
import random
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from flowlock.checker import DOUBLE_APPLY, LOST_UPDATE, Verdict, Violation
from flowlock.core.errors import (
    ConflictRetriesExhausted,
    ConnectionLost,
    GuardRejected,
    InstanceExists,
    InvalidInput,
    LockBusy,
    LockLost,
    LockTimeout,
    LockUnavailable,
    OutcomeUnknown,
    StepFailed,
    StoreBusy,
    StoreError,
    TransitionNotAllowed,
)
from flowlock.core.models import HistoryEntry, Instance
from flowlock_lab.faults import FaultInjector, Schedule
from flowlock_lab.soak_config import MAX_SOAK_CALLERS, SoakConfig
from flowlock_lab.soak_report import render_soak, soak_to_json, write_soak_json
from flowlock_lab.soak_results import (
    FAULT_KINDS,
    MAX_SOAK_SECONDS,
    OUTCOME_KINDS,
    Expected,
    Fault,
    Leaks,
    SoakReport,
    classify,
    count_outcomes,
    judge_store,
)

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def test_classify_names_each_kind_and_what_the_checker_is_told() -> None:
    """Typed refusals before any write are fail; OutcomeUnknown and anything not flowlock's
    are unknown (the latter escaped)."""
    cases = [
        (TransitionNotAllowed("a", "reject", "approved", [], 2), ("refused", "fail")),
        (GuardRejected("no"), ("refused", "fail")),
        (InstanceExists("a"), ("refused", "fail")),
        (ConflictRetriesExhausted("step", "hot", 3), ("conflict", "fail")),
        (LockTimeout("hot", 5.0), ("lock", "fail")),
        (LockBusy("hot"), ("lock", "fail")),
        (LockUnavailable("redis", "down"), ("lock", "fail")),
        (LockLost("hot", "a newer lease"), ("lock", "fail")),
        (StoreError("rolled back"), ("store", "fail")),
        (StoreBusy(5.0, 4), ("store", "fail")),
        (ConnectionLost("hot", "reset"), ("store", "fail")),
        (OutcomeUnknown("hot", "reset"), ("unknown", "unknown")),
        (RuntimeError("a bug"), ("escaped", "unknown")),
        (KeyError("x"), ("escaped", "unknown")),
    ]
    for exc, expected in cases:
        assert classify(exc) == expected, exc
    failed = StepFailed(
        workflow="counter",
        event="step",
        instance_id="hot",
        step="effect",
        state="open",
        version=2,
        error=ValueError("x"),
    )
    kind, status = classify(failed)
    assert (kind, status) == ("other", "unknown")


def _instance(
    iid: str, workflow: str, state: str, version: int, n: int | None = None, last: str | None = None
) -> Instance:
    data = {} if n is None else {"n": n}
    return Instance(iid, workflow, state, version, data, last, NOW, NOW)


def _row(
    iid: str, version: int, event: str, frm: str, to: str, n: int | None = None
) -> HistoryEntry:
    data = {} if n is None else {"n": n}
    return HistoryEntry(
        iid, version, event, frm, to, "a", f"r{iid}{version}", "optimistic", data, NOW
    )


def _counter(
    iid: str, steps: int, values: list[int] | None = None
) -> tuple[Instance, list[HistoryEntry]]:
    values = values if values is not None else list(range(1, steps + 1))
    rows = [_row(iid, v + 2, "step", "open", "open", values[v]) for v in range(steps)]
    last = "step" if steps else None
    return _instance(iid, "counter", "open", steps + 1, values[-1] if values else 0, last), rows


def _rule(entry: HistoryEntry) -> str | None:
    return None if entry.data.get("n") == entry.version - 1 else "a step was lost"


def test_judge_store_accepts_rows_between_applied_and_applied_plus_unknown() -> None:
    """Three steps in history: clean for 3 applied, or 2 applied and 1 unknown; a double apply
    beyond applied + unknown, a lost update below applied."""
    final, rows = _counter("c", 3)
    finals, histories = {"c": final}, {"c": rows}
    assert judge_store(finals, histories, {"c": Expected("open", 3)}).ok
    assert judge_store(finals, histories, {"c": Expected("open", 2, 1)}).ok
    over = judge_store(finals, histories, {"c": Expected("open", 1, 1)})
    assert DOUBLE_APPLY in {v.kind for v in over.violations}
    under = judge_store(finals, histories, {"c": Expected("open", 4, 2)})
    assert LOST_UPDATE in {v.kind for v in under.violations}
    assert not judge_store(finals, histories, {"c": Expected("open", 2)}).ok


def test_judge_store_runs_the_workflows_rule_on_every_row() -> None:
    """A counter whose value skipped a step (a lost update) fails its rule."""
    final, rows = _counter("c", 3, [1, 1, 2])
    verdict = judge_store(
        {"c": final}, {"c": rows}, {"c": Expected("open", 3)}, rules={"counter": _rule}
    )
    assert [v.kind for v in verdict.violations] == [LOST_UPDATE, LOST_UPDATE]


def test_judge_store_decides_an_approval_at_most_once() -> None:
    """An approval decided twice is a double apply even when unknown calls could explain the
    rows; one never created is skipped, and one answered applied but missing is lost."""
    final = _instance("s", "approval", "rejected", 3, last="reject")
    rows = [
        _row("s", 2, "approve", "pending", "approved"),
        _row("s", 3, "reject", "approved", "rejected"),
    ]
    verdict = judge_store({"s": final}, {"s": rows}, {"s": Expected("pending", 1, 3, True)})
    assert DOUBLE_APPLY in {v.kind for v in verdict.violations}
    assert judge_store({}, {}, {"never": Expected("pending", 0, 2, True)}).ok
    gone = judge_store({}, {}, {"gone": Expected("pending", 1, 0, True)})
    assert [v.kind for v in gone.violations] == [LOST_UPDATE]


def _report(**changes: object) -> SoakReport:
    fields: dict[str, object] = {
        "flowlock_version": "0.1.0",
        "postgres_version": "18.6",
        "redis_version": "7.0.15",
        "cores": 2,
        "args": {"seconds": 60, "faults": True, "processes": 3, "callers": 12, "seed": 7},
        "duration_s": 60.2,
        "calls": 10,
        "outcomes": {"applied": 6, "refused": 2, "killed": 2},
        "errors": {"TransitionNotAllowed": 2, "LockLost": 1},
        "faults": (
            Fault("kill-worker", 1.0, "w1"),
            Fault("pause-worker", 3.0, "w2 for 3.0 s"),
            Fault("restart-redis", 5.0, "", ok=False, detail="EmbeddedServerError: down"),
        ),
        "leaks": Leaks(),
        "linearizable": True,
        "linearizability": {"ok": True, "calls": 10, "instances": 3, "violations": []},
        "exactly_once": Verdict.of([]),
        "workers_started": 4,
    }
    fields.update(changes)
    return SoakReport(**fields)  # type: ignore[arg-type]


def test_the_report_is_ok_only_when_every_verdict_is_clean() -> None:
    """ok needs both verdicts, no escaped or hung call, no crash and no leak; problems() says
    which failed."""
    assert _report().ok and _report().problems() == []
    assert _report().faults_by_kind == {"kill-worker": 1, "pause-worker": 1}
    assert _report().faults_failed == 1
    assert _report().leases_lost == 1
    failing = [
        _report(linearizable=False, linearizability={"describe": "2 violations"}),
        _report(exactly_once=Verdict.of([Violation(DOUBLE_APPLY, "instance 's': twice")])),
        _report(outcomes={"applied": 9, "escaped": 1}),
        _report(outcomes={"applied": 9, "hung": 1}),
        _report(crashes=("w1 exited with status 1",)),
        _report(leaks=Leaks(advisory_locks=1)),
        _report(leaks=Leaks(redis_lock_keys=2)),
        _report(leaks=Leaks(connections=1)),
    ]
    for report in failing:
        assert not report.ok
        assert report.problems()


def test_count_outcomes_keeps_the_documented_order_and_sums_to_the_calls() -> None:
    """Counted in OUTCOME_KINDS order, kinds that never happened left out."""
    kinds = ["store", "applied", "applied", "killed", "read"]
    counted = count_outcomes(kinds)  # type: ignore[arg-type]
    assert list(counted) == ["applied", "read", "store", "killed"]
    assert sum(counted.values()) == len(kinds)
    assert set(OUTCOME_KINDS) >= set(counted)


def test_json_and_table_carry_every_figure(tmp_path: Path) -> None:
    """The JSON document has the figures docs/benchmarks.md names; the table shows the
    duration, calls, outcomes, faults by kind and the verdicts."""
    report = _report()
    doc = soak_to_json(report)
    for key in (
        "duration_s",
        "calls",
        "outcomes",
        "errors",
        "faults",
        "fault_log",
        "leases_lost",
        "leaks",
        "escaped",
        "linearizability",
        "exactly_once",
        "ok",
    ):
        assert key in doc, key
    assert doc["faults"] == {"kill-worker": 1, "pause-worker": 1}
    assert doc["ok"] is True and doc["linearizability"]["ok"] is True
    path = tmp_path / "soak.json"
    write_soak_json(report, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    out = io.StringIO()
    render_soak(report, Console(file=out, width=200))
    text = out.getvalue()
    for shown in ("60.2 s", "applied 6", "kill-worker 1", "1 could not be done", "verdict"):
        assert shown in text, shown


def test_the_schedule_gives_every_kind_once_per_cycle_and_pauses_around_the_ttl() -> None:
    """Each cycle of five faults has each kind once; gaps are the interval +- 50 %; pauses run
    from a tenth of the lease ttl to twice it (about half outlive it)."""
    schedule = Schedule(random.Random(1), interval=3.0, lease_ttl=2.0)
    for _ in range(4):
        assert sorted(schedule.next_kind() for _ in FAULT_KINDS) == sorted(FAULT_KINDS)
    gaps = [schedule.gap() for _ in range(200)]
    assert all(1.5 <= g <= 4.5 for g in gaps)
    pauses = [schedule.pause() for _ in range(200)]
    assert all(0.2 <= p <= 4.0 for p in pauses)
    assert any(p > 2.0 for p in pauses) and any(p < 2.0 for p in pauses)
    one, two = (Schedule(random.Random(7), interval=3.0, lease_ttl=2.0) for _ in range(2))
    assert [one.next_kind() for _ in range(12)] == [two.next_kind() for _ in range(12)]


def test_the_soak_config_refuses_what_cannot_run() -> None:
    """Seconds out of 1..3600, a server URL, too many processes or callers, the raw floor, an
    unknown strategy: InvalidInput before anything starts; the defaults fit a 2-core machine."""
    SoakConfig(seconds=60, faults=True).validate()
    default = SoakConfig(seconds=60)
    assert (default.process_count(), default.caller_count()) == (3, 12)
    assert "raw" not in default.strategy_names()
    bad = [
        SoakConfig(seconds=0),
        SoakConfig(seconds=MAX_SOAK_SECONDS + 1),
        SoakConfig(seconds=60, faults=True, database_url="postgresql://x@y/z"),
        SoakConfig(seconds=60, redis_url="redis://127.0.0.1:6379/0"),
        SoakConfig(seconds=60, processes=9),
        SoakConfig(seconds=60, processes=4, callers=3),
        SoakConfig(seconds=60, callers=MAX_SOAK_CALLERS + 1),
        SoakConfig(seconds=60, strategies=("raw",)),
        SoakConfig(seconds=60, strategies=("nope",)),
        SoakConfig(seconds=60, fault_interval=0.1),
        SoakConfig(seconds=60, max_faults=-1),
    ]
    for config in bad:
        with pytest.raises(InvalidInput):
            config.validate()
    with pytest.raises(InvalidInput, match="servers of its own"):
        SoakConfig(seconds=60, faults=True, database_url="postgresql://x@y/z").validate()
    assert SoakConfig(seconds=60, fault_interval=3.0).fault_cap() == 41
    assert SoakConfig(seconds=3600, fault_interval=0.5).fault_cap() == 2000


class _Recording:
    """Targets that only note what they were asked (the kill fails: nothing to kill)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.paused_for: list[float] = []

    async def kill_worker(self, rng: random.Random) -> str:
        self.asked.append("kill-worker")
        raise InvalidInput("no worker process is running")

    async def pause_worker(self, rng: random.Random, seconds: float) -> str:
        self.asked.append("pause-worker")
        self.paused_for.append(seconds)
        await asyncio.sleep(seconds)
        return f"w0 for {seconds:.1f} s"

    async def terminate_backends(self, rng: random.Random) -> str:
        self.asked.append("terminate-backend")
        return "1 of 4 session(s)"

    async def restart_postgres(self) -> str:
        self.asked.append("restart-postgres")
        return "PostgreSQL"

    async def restart_redis(self) -> str:
        self.asked.append("restart-redis")
        return "Redis (empty)"


@pytest.mark.slow
async def test_the_injector_records_each_fault_and_ends_before_the_stop() -> None:
    """Faults every ~0.5 s until a second before the stop, each recorded (a failed one with
    ok=False and why), pauses awaited before run() returns, and never more than max_faults."""
    targets = _Recording()
    started = time.monotonic()
    injector = FaultInjector(
        targets,
        Schedule(random.Random(3), interval=0.5, lease_ttl=0.2),
        started=started,
        max_faults=8,
    )
    await injector.run(started + 4.0)
    assert time.monotonic() - started < 4.0 + 1.0
    assert 1 <= len(injector.faults) <= 8
    assert [f.kind for f in injector.faults if f.kind != "pause-worker"] == [
        k for k in targets.asked if k != "pause-worker"
    ]
    for fault in injector.faults:
        assert fault.ok == (fault.kind != "kill-worker")
        if not fault.ok:
            assert "no worker process" in fault.detail
    assert all(0.02 <= s <= 0.4 for s in targets.paused_for)
    capped = FaultInjector(
        _Recording(),
        Schedule(random.Random(3), interval=0.5, lease_ttl=0.2),
        started=started,
        max_faults=0,
    )
    await capped.run(time.monotonic() + 3.0)
    assert capped.faults == []
