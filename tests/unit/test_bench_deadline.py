"""The bench's deadline scenario and timers section without PostgreSQL: the judge and the race
figures on hand-built rounds, the round's setup on the memory store, calls made at their time,
the idle cost's bookkeeping, and the section in the JSON and the tables."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rich.console import Console
from test_bench_report import _report, _result

import flowlock
from flowlock.bench import SCENARIOS, BenchConfig
from flowlock.bench.idle import KINDS, _Seen, statement_kind, with_database
from flowlock.bench.measure import Armed, until
from flowlock.bench.report import render, to_json
from flowlock.bench.report.cells import ELLIPSIS
from flowlock.bench.results import CallResult, CallSpec, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios import Deadline, Fired, Scenario
from flowlock.bench.scenarios.deadline import JITTER, RACE_WORKFLOW, TIMER_NOT_ARMED, race_after
from flowlock.bench.timer_results import (
    IdleFigures,
    LagFigures,
    Quantiles,
    RaceFigures,
    TimersSection,
)
from flowlock.checker import DOUBLE_APPLY, LOST_UPDATE, STRAY_TIMER
from flowlock.core.errors import InvalidInput
from flowlock.core.models import TIMER_ACTOR, HistoryEntry, Instance, Timer, timer_request_id
from flowlock.engine import Engine

DUE = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SCENARIO = Deadline()
PARAMS = Params(workers=2, ops=2, processes=4)


def _row(iid: str, event: str, actor: str, ms: float, to: str) -> HistoryEntry:
    request = timer_request_id(1, "expire", 0) if actor == TIMER_ACTOR else None
    return HistoryEntry(
        instance_id=iid,
        version=2,
        event=event,
        from_state="pending",
        to_state=to,
        actor=actor,
        request_id=request,
        strategy="optimistic",
        data={},
        at=DUE + timedelta(milliseconds=ms),
    )


def _final(iid: str, state: str, rows: Sequence[HistoryEntry]) -> Instance:
    return Instance(
        id=iid,
        workflow=RACE_WORKFLOW,
        state=state,
        version=1 + len(rows),
        data={},
        last_event=rows[-1].event if rows else None,
    )


def _round(
    outcomes: dict[str, tuple[str, list[HistoryEntry]]],
    kinds: dict[str, str],
    *,
    timers: dict[str, list[Timer]] | None = None,
    unarmed: Sequence[str] = (),
) -> RoundRecord:
    """A round whose instance `iid` ended `outcomes[iid]` (state, rows), its caller answered
    `kinds[iid]`, 40 ms after the due time."""
    due = DUE.timestamp()
    calls = {iid: CallSpec(iid, "approve", actor=f"approver-{iid}", at=due) for iid in outcomes}
    results = tuple(CallResult(calls[iid], kinds[iid], 0.04, 1) for iid in outcomes)  # type: ignore[arg-type]
    plan = RoundPlan(
        dict.fromkeys(outcomes, "pending"),
        tuple(calls.values()),
        extra={"due": dict.fromkeys(outcomes, due), "unarmed": list(unarmed), "offset": 0.0},
    )
    finals = {iid: _final(iid, state, rows) for iid, (state, rows) in outcomes.items()}
    histories = {iid: rows for iid, (_, rows) in outcomes.items()}
    return RoundRecord(plan, results, finals, histories, {"timers": timers or {}})


def _clean() -> RoundRecord:
    return _round(
        {
            "a": ("approved", [_row("a", "approve", "approver-a", 1, "approved")]),
            "b": ("rejected", [_row("b", "expire", TIMER_ACTOR, 25, "rejected")]),
            "c": ("rejected", [_row("c", "expire", TIMER_ACTOR, 75, "rejected")]),
        },
        {"a": "applied", "b": "refused", "c": "refused"},
    )


# -- the scenario -------------------------------------------------------------------------------


def test_deadline_runs_in_worker_processes_with_timers_and_no_floor() -> None:
    """`deadline` is registered, runs its callers in the worker processes, fires its timers
    there, has no raw floor, and takes --ops (2,000 instances by default, 200 quick)."""
    deadline = SCENARIOS["deadline"]
    assert isinstance(deadline, Deadline)
    assert deadline.multiprocess and deadline.timed and not deadline.has_floor
    config = BenchConfig(scenarios=("deadline",))
    assert config.params_for(deadline).workers * config.ops_for(deadline) == 2000
    quick = BenchConfig(scenarios=("deadline",), quick=True)
    assert quick.params_for(deadline).workers * quick.ops_for(deadline) == 200
    names = [w.name for w in deadline.workflows(Params())]
    assert names == ["deadline", "deadline-lag"]
    assert all(w.has_timers for w in deadline.workflows(Params()))


def test_deadline_cannot_go_through_http() -> None:
    """--http refuses deadline, saying its expiries are the worker processes' own."""
    with pytest.raises(InvalidInput, match="timer services"):
        BenchConfig(http=True, scenarios=("deadline",)).validate()


def test_a_clean_race_has_no_violation() -> None:
    """Approved by its caller (told applied), or rejected by its timer (the caller refused):
    no violation, nothing double-advanced."""
    judged = SCENARIO.judge(_clean(), PARAMS)
    assert judged.violations == ()
    assert not judged.double_advanced


def test_the_judge_catches_both_outcomes_applied() -> None:
    """Two rows (the approval and the expiry both applied) is a double apply."""
    both = [
        _row("a", "approve", "approver-a", 1, "approved"),
        replace(_row("a", "expire", TIMER_ACTOR, 2, "rejected"), version=3, from_state="approved"),
    ]
    record = _round({"a": ("rejected", both)}, {"a": "applied"})
    judged = SCENARIO.judge(record, PARAMS)
    assert judged.double_advanced
    assert DOUBLE_APPLY in {v.kind for v in judged.violations}


@pytest.mark.parametrize(
    ("outcome", "kind", "found"),
    [
        (("pending", []), "failed", LOST_UPDATE),  # nobody resolved it
        (("approved", [_row("a", "approve", TIMER_ACTOR, 1, "approved")]), "refused", LOST_UPDATE),
        (("rejected", [_row("a", "expire", "approver-a", 1, "rejected")]), "refused", LOST_UPDATE),
        (("approved", [_row("a", "approve", "approver-a", 1, "approved")]), "refused", None),
    ],
)
def test_the_judge_names_who_wrote_the_outcome(
    outcome: tuple[str, list[HistoryEntry]], kind: str, found: str | None
) -> None:
    """Still pending, an approval not by its caller, an expiry not by its timer, or an
    approval whose caller was told refused: each is a violation."""
    judged = SCENARIO.judge(_round({"a": outcome}, {"a": kind}), PARAMS)
    kinds = {v.kind for v in judged.violations}
    assert kinds, judged
    if found is not None:
        assert found in kinds


def test_the_judge_catches_timers_left_armed_and_unarmed_instances() -> None:
    """A timer still armed after the stay ended (the checker's stray timer), and an instance
    created without its expiry."""
    left = Timer("a", RACE_WORKFLOW, "expire", 1, DUE)
    record = _round(
        {"a": ("approved", [_row("a", "approve", "approver-a", 1, "approved")])},
        {"a": "applied"},
        timers={"a": [left]},
        unarmed=["a"],
    )
    kinds = {v.kind for v in SCENARIO.judge(record, PARAMS).violations}
    assert {STRAY_TIMER, TIMER_NOT_ARMED} <= kinds
    race = SCENARIO.race([record], PARAMS, ())
    assert race is not None and race.left_armed == 1


def test_race_figures_count_each_outcome_and_the_span() -> None:
    """Approved and rejected counted, every instance once; the span runs from the due time to
    the last resolved (an expiry's row at 75 ms, after the approval answered at 40 ms)."""
    race = SCENARIO.race([_clean()], PARAMS, (2, 1, 0, 0))
    assert race is not None
    assert (race.instances, race.approved, race.rejected, race.unresolved) == (3, 1, 2, 0)
    assert race.exactly_one and race.checker_ok and race.left_armed == 0
    assert race.span_s == pytest.approx(0.075, abs=1e-6)
    assert race.resolved_per_s == pytest.approx(40.0)
    assert race.expiry_lag.count == 2
    assert race.expiry_lag.p50_ms == pytest.approx(25.0, abs=0.01)
    assert race.expiry_lag.p99_ms == pytest.approx(75.0, abs=0.01)
    assert race.firings_by_engine == (2, 1, 0, 0)
    assert race.engines == 4
    assert not race.met  # 40 resolved a second is below the target


def test_race_figures_say_when_not_every_instance_ended_once() -> None:
    """A pending instance is unresolved, and the race is not exactly-one."""
    record = _round({"a": ("pending", [])}, {"a": "failed"})
    race = SCENARIO.race([record], PARAMS, ())
    assert race is not None
    assert race.unresolved == 1 and not race.exactly_one and not race.checker_ok


def test_other_scenarios_have_no_race() -> None:
    """Only deadline fills the timers section's race."""
    assert SCENARIOS["storm"].race([], PARAMS, ()) is None


def test_the_expiry_waits_for_the_round_to_be_armed() -> None:
    """The race's `after` grows with its instances: half a second, plus 2 ms each."""
    assert race_after(200) == pytest.approx(0.9)
    assert race_after(2000) == pytest.approx(4.5)


async def test_setup_arms_one_expiry_per_instance_and_a_call_at_its_due_time() -> None:
    """On the memory store: every instance created pending with one expiry armed, and its
    caller's approval set at the due time, within the jitter either side."""
    async with flowlock.connect("memory://", timers=False) as engine:
        for wf in SCENARIO.workflows(PARAMS):
            await engine.register(wf)
        import random

        plan = await SCENARIO.setup(engine, "r1", PARAMS, random.Random(3))
        assert len(plan.instances) == PARAMS.workers * PARAMS.ops
        assert set(plan.instances.values()) == {"pending"}
        dues = plan.extra["due"]
        assert plan.extra["unarmed"] == [] and set(dues) == set(plan.instances)
        for call in plan.calls:
            assert call.event == "approve" and call.at is not None
            assert abs(call.at - dues[call.instance_id]) <= JITTER + 1e-6
            timers = await engine.timers(call.instance_id)
            assert [(t.event, t.stay) for t in timers] == [("expire", 1)]


# -- calls made at their time ---------------------------------------------------------------------


class _Clock:
    """A session that notes when each call was made (wall clock)."""

    strategy = "fake"

    def __init__(self) -> None:
        self.made: dict[str, float] = {}

    @property
    def engine(self) -> Engine:
        raise NotImplementedError

    @property
    def pool(self) -> Any:
        raise NotImplementedError

    async def fire(self, call: CallSpec) -> Fired:
        self.made[call.instance_id] = time.time()
        return Fired("applied")

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool | None:
        return None


async def test_a_call_with_a_time_waits_for_it_and_is_timed_from_it() -> None:
    """A call with `at` is made no earlier than `at`; its latency counts from `at`, and the
    round's wall time from the earliest `at`; a late call goes at once."""
    session = _Clock()
    soon = time.time() + 0.15
    lanes = [[CallSpec("a", "approve", at=soon)], [CallSpec("b", "approve", at=time.time() - 1)]]
    armed = Armed(Scenario(), session, lanes)
    await asyncio.wait_for(armed.ready(), 1)
    results, wall = await armed.go()
    assert session.made["a"] >= soon - 0.002
    by_id = {r.call.instance_id: r for r in results}
    assert by_id["a"].latency < 0.1  # counted from its time, not from the release
    assert by_id["b"].latency >= 1.0  # a late call counts from the time it was due
    assert wall >= 1.0


async def test_until_returns_the_moment_on_the_perf_counter() -> None:
    """until() of a past time answers that time on the perf counter, without sleeping."""
    now = time.perf_counter()
    then = await until(time.time() - 2)
    assert now - 2.1 < then < now - 1.9


# -- the idle cost's bookkeeping ----------------------------------------------------------------


def test_statements_are_told_apart_by_what_sent_them() -> None:
    """The LISTEN connection's, the timer service's, the escalation board's, and the rest."""
    assert statement_kind("flowlock-ab-timers", 'LISTEN "flowlock_timers.s"') == "listen"
    assert statement_kind("flowlock-ab-timers", "SELECT 1") == "listen"
    assert statement_kind("flowlock-ab", "WITH due AS (SELECT 1 FROM flowlock_timers)") == "timers"
    assert statement_kind("flowlock-ab", "SELECT key FROM flowlock_escalations") == "escalations"
    assert statement_kind("flowlock-ab", "SELECT extract(epoch FROM clock_timestamp())") == (
        "escalations"
    )
    assert statement_kind("flowlock-ab", "SELECT 1") == "other"


def test_a_statement_is_counted_once_by_its_connection_and_start() -> None:
    """Looks that see the same (pid, start) count one statement; only starts inside the window
    count; backends that are not the engine's are set apart."""
    seen = _Seen()
    row = {"pid": 7, "kind": "client backend", "app": "flowlock-ab", "started": 10.5}
    timers = {**row, "query": "SELECT min(due_at) FROM flowlock_timers"}
    seen.look([timers, timers], "flowlock-ab")  # type: ignore[list-item]
    seen.look([{**timers, "started": 12.0}], "flowlock-ab")  # type: ignore[list-item]
    vacuum = {"pid": 9, "kind": "autovacuum worker", "app": "", "started": 10.7, "query": ""}
    runner = {**vacuum, "pid": 3, "kind": "client backend", "app": "flowlock-bench"}
    seen.look([vacuum, runner], "flowlock-ab")  # type: ignore[list-item]
    assert seen.between(10.0, 11.0) == {**dict.fromkeys(KINDS, 0), "timers": 1}
    assert seen.between(10.0, 13.0)["timers"] == 2
    assert seen.others == {9}


def test_the_idle_database_is_named_in_the_url() -> None:
    """The dedicated database replaces the URL's own; the rest of the URL stays."""
    url = "postgresql://u:p@h:5433/test?sslmode=disable"
    assert with_database(url, "x_idle") == "postgresql://u:p@h:5433/x_idle?sslmode=disable"


# -- the report ---------------------------------------------------------------------------------


def _section() -> TimersSection:
    lag = LagFigures(
        engines=4,
        armed=100_000,
        due_per_s=1000.0,
        window_s=10.0,
        lag=Quantiles(10_000, 17.8, 57.2, 147.8),
        missed=0,
        fired_total=14_001,
        firings_by_engine=(3543, 3597, 3625, 3236),
        checker_ok=True,
        violations=0,
        strategy="optimistic",
    )
    idle = IdleFigures(
        engines=1,
        armed=100_000,
        window_s=10.0,
        statements_per_s={"timers": 0.0, "listen": 0.0, "escalations": 2.1, "other": 0.0},
        scans_per_s={"flowlock_timers": 0.0, "flowlock_escalations": 2.2},
        database="dedicated",
        method="m",
    )
    return TimersSection((replace(lag, engines=1, firings_by_engine=(14_001,)), lag), idle)


def _race() -> RaceFigures:
    return RaceFigures(
        engines=4,
        instances=2000,
        approved=1925,
        rejected=75,
        unresolved=0,
        exactly_one=True,
        span_s=0.593,
        expiry_lag=Quantiles(75, 271.7, 502.0, 510.0),
        left_armed=0,
        checker_ok=True,
        violations=0,
        firings_by_engine=(120, 130, 140, 130),
    )


def _timed_report() -> Any:
    raced = _result("optimistic", scenario="deadline", race=_race())
    return replace(_report(raced), timers=_section())


def test_the_json_has_the_timers_section() -> None:
    """`timers` holds the race per strategy, the lag per engine count, the idle cost, and the
    targets; every figure is JSON as is."""
    doc = to_json(_timed_report())
    timers = doc["timers"]
    json.dumps(timers)
    (race,) = timers["race"]
    assert race["strategy"] == "optimistic"
    assert race["exactly_one"] is True and race["checker"] == {"ok": True, "violations": 0}
    assert race["resolved_per_s"] == pytest.approx(3372.7, abs=0.1)
    assert race["approved"] + race["rejected"] == race["instances"]
    assert [lag["engines"] for lag in timers["lag"]] == [1, 4]
    assert timers["lag"][1]["p99_ms"] == 57.2 and timers["lag"][1]["met"] is True
    idle = timers["idle"]
    assert idle["timer_statements_per_s"] == 0.0 and idle["met"] is True
    assert idle["statements_by_kind"]["escalations"] == 2.1
    assert timers["targets"] == {
        "race_resolved_per_s": 1000.0,
        "lag_p99_ms": 100.0,
        "idle_timer_statements_per_s": 0.0,
    }
    assert to_json(_report(_result("optimistic")))["timers"] is None


def test_a_lag_run_the_checker_failed_fails_the_report() -> None:
    """The report is not ok when a lag run's firings were not applied exactly once."""
    report = _timed_report()
    assert report.ok
    section = report.timers
    bad = replace(section.lag[0], checker_ok=False, violations=2)
    assert not replace(report, timers=replace(section, lag=(bad,))).ok


def test_an_idle_cost_without_scans_shows_a_dash() -> None:
    """Under --quick the scans are not counted: null in the JSON, a dash in the table."""
    report = _timed_report()
    section = report.timers
    idle = replace(section.idle, scans_per_s=None)
    quick = replace(report, timers=replace(section, idle=idle))
    assert to_json(quick)["timers"]["idle"]["scans_per_s"] is None
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    render(quick, console)
    row = next(line for line in console.export_text().splitlines() if "1 engine " in line)
    assert row.split()[-2] == "—"


@pytest.mark.parametrize("width", [80, 120, 160])
def test_the_timers_tables_fit_the_terminal(width: int) -> None:
    """The three tables print whole at 80, 120 and 160 columns, their figures as words."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    render(_timed_report(), console)
    text = console.export_text()
    assert ELLIPSIS not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for shown in ("3,373", "271.7", "502.0", "57.2", "147.8", "2.10", "1,925"):
        assert shown in text, shown
    for title in ("the race (deadline)", "firing lag", "idle cost"):
        assert title in text
