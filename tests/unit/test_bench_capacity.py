"""The bench's capacity scenarios without PostgreSQL: the slot log's replay, the history match,
Jain's index, the scenarios' place in a run, their rounds' shape, and their JSON fields."""

from __future__ import annotations

import io
import random
from collections.abc import Sequence

import pytest
from rich.console import Console
from test_bench_report import _report, _result

from flowlock.bench import SCENARIO_ALIASES, SCENARIOS, BenchConfig
from flowlock.bench.capacity_results import (
    OVER_CAPACITY,
    SLOT_LOG,
    CapacityFigures,
    LogRow,
    jain,
    match_history,
    prove_holders,
)
from flowlock.bench.report import render, to_json
from flowlock.bench.report.aims import FLOOR_METHOD
from flowlock.bench.results import CallResult, CallSpec, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios import CapacitySpread, CapacityStorm, CapacityWait
from flowlock.bench.scenarios.capacity import HELD, LIMIT, WORKFLOW, capacity_workflow
from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Instance
from flowlock.engine import Engine
from flowlock.stores.constraint_store import ConstraintRows, CounterRow, SlotEvent, SlotRow
from flowlock.stores.memory import MemoryStore


def _log(key: str, deltas: Sequence[int], holders: Sequence[int] | None = None) -> list[LogRow]:
    """A key's slot events from their deltas; the recorded counts replayed unless given."""
    rows: list[LogRow] = []
    held = 0
    for seq, delta in enumerate(deltas, start=1):
        held += delta
        shown = held if holders is None else holders[seq - 1]
        rows.append(LogRow(key, seq, f"i{seq}", delta, shown))
    return rows


def _entry(iid: str, version: int, src: str, dst: str) -> HistoryEntry:
    return HistoryEntry(
        instance_id=iid,
        version=version,
        event="enter" if dst == HELD else "leave",
        from_state=src,
        to_state=dst,
        actor="c0",
        request_id=None,
        strategy="optimistic",
        data={"key": "k"},
    )


# -- the proof -------------------------------------------------------------------------------------


def test_a_log_that_reaches_the_limit_and_no_further_is_clean() -> None:
    """Five takes, a release, a take, then all released: the peak is the limit, nothing wrong."""
    proof = prove_holders(_log("k", [1, 1, 1, 1, 1, -1, 1, -1, -1, -1, -1, -1]), LIMIT)
    assert proof.max_holders == LIMIT
    assert proof.problems == ()


def test_one_holder_above_the_limit_is_an_over_capacity_violation() -> None:
    """A sixth take without a release between is found, with the key named."""
    proof = prove_holders(_log("k", [1] * 6) + _log("other", [1, -1]), LIMIT)
    assert proof.max_holders == 6
    assert [v.kind for v in proof.problems] == [OVER_CAPACITY]
    assert "'k'" in proof.problems[0].message


def test_the_count_is_replayed_not_trusted() -> None:
    """A writer that recorded 5 holders where the deltas make 6 is caught twice: its count does
    not add up, and the replayed peak is over the limit."""
    proof = prove_holders(_log("k", [1] * 6, holders=[1, 2, 3, 4, 5, 5]), LIMIT)
    assert {v.kind for v in proof.problems} == {SLOT_LOG, OVER_CAPACITY}
    assert proof.max_holders == 6


def test_a_gap_in_a_keys_sequence_is_a_slot_log_violation() -> None:
    """Events 1, 2, 4: the third is missing, and the replay says so."""
    rows = _log("k", [1, 1, 1])
    rows[2] = LogRow("k", 4, "i4", 1, 3)
    proof = prove_holders(rows, LIMIT)
    assert [v.kind for v in proof.problems] == [SLOT_LOG]


def test_every_move_in_history_has_its_slot_event_and_no_event_lacks_its_move() -> None:
    """A matching log is clean; a move in and out without events, and an event of no move,
    are each named."""
    histories = {
        "a": [_entry("a", 2, "idle", HELD), _entry("a", 3, HELD, "idle")],
        "b": [_entry("b", 2, "idle", HELD)],
    }
    log = [LogRow("k", 1, "a", 1, 1), LogRow("k", 2, "a", -1, 0), LogRow("k", 3, "b", 1, 1)]
    assert match_history(log, histories, HELD) == []
    found = match_history([*log[:2], LogRow("k", 3, "c", 1, 1)], histories, HELD)
    assert [v.kind for v in found] == [SLOT_LOG, SLOT_LOG]
    assert "'b'" in found[0].message and "without a slot take" in found[0].message
    assert "'c'" in found[1].message and "without a move" in found[1].message


def test_jains_index() -> None:
    """1 for equal shares, 1/n when one caller gets everything, 0 when nobody got anything,
    None without callers."""
    assert jain([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([4.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([0.0, 0.0]) == 0.0
    assert jain([]) is None


# -- the scenarios in a run ------------------------------------------------------------------------


def test_capacity_names_its_three_scenarios_with_the_counter_floor() -> None:
    """-s capacity runs capacity-spread, capacity-storm and capacity-wait, all registered
    (the quick bench runs them; a full run only when named), floored by the hand-written
    counter row, with --ops."""
    assert SCENARIO_ALIASES["capacity"] == ("capacity-spread", "capacity-storm", "capacity-wait")
    assert BenchConfig(scenarios=("capacity",)).scenario_names() == SCENARIO_ALIASES["capacity"]
    assert set(SCENARIO_ALIASES["capacity"]) <= set(BenchConfig(quick=True).scenario_names())
    assert not set(SCENARIO_ALIASES["capacity"]) & set(BenchConfig().scenario_names())
    for name in SCENARIO_ALIASES["capacity"]:
        scenario = SCENARIOS[name]
        assert scenario.has_floor and scenario.floor == "counter" and scenario.uses_ops
        assert scenario.tallied
    assert "holders < limit" in FLOOR_METHOD["counter"]


def test_capacity_runs_ten_callers_a_worker_and_quick_runs_one() -> None:
    """1,000 callers for the default 100 workers (the issue's figure); --quick runs 50, one
    instance each; the other scenarios keep one caller a worker."""
    spread = SCENARIOS["capacity-spread"]
    assert BenchConfig().params_for(spread) == Params(workers=1000, ops=10)
    assert BenchConfig(quick=True).params_for(spread) == Params(workers=50, ops=1)
    assert BenchConfig().params_for(SCENARIOS["capacity-storm"]).ops == 3
    assert BenchConfig().params_for(SCENARIOS["storm"]).workers == 100


def test_http_and_hosts_refuse_the_capacity_scenarios() -> None:
    """Their callers' refusals are tallied in the bench's own process: neither the service nor
    the worker processes of --hosts can run them, and the refusal says what to do."""
    with pytest.raises(InvalidInput, match="tallied in the bench's process"):
        BenchConfig(http=True, scenarios=("capacity-spread",)).validate()
    with pytest.raises(InvalidInput, match="drop --scenario capacity-spread"):
        BenchConfig(hosts=2, scenarios=("capacity",)).validate()


def test_the_workflow_holds_five_slots_per_key_of_the_data() -> None:
    """idle -> held -> idle by enter and leave; held counts 5 per data['key'], kind
    capacity.held."""
    wf = capacity_workflow()
    (slots,) = wf.constraints.slots
    assert slots.kind == f"{WORKFLOW}.{HELD}" and slots.limit == LIMIT
    assert slots.states == frozenset({HELD})
    assert set(wf.transitions) == {"enter", "leave"}


async def test_a_spread_round_gives_each_caller_its_own_instances_over_the_keys() -> None:
    """40 callers x 2 instances: 80 instances over 2 keys (one per 20 callers), 40 each; each
    caller's lane enters and leaves its instances in turn."""
    engine = Engine(MemoryStore(), timers=False)
    async with engine:
        scenario = CapacitySpread()
        await engine.register(capacity_workflow())
        plan = await scenario.setup(engine, "r1", Params(workers=40, ops=2), random.Random(1))
        assert len(plan.instances) == 80 and set(plan.instances.values()) == {"idle"}
        assert plan.extra["keys"] == ["r1-k0", "r1-k1"]
        keys = [(await engine.get(iid)).data["key"] for iid in plan.instances]
        assert sorted(keys.count(k) for k in plan.extra["keys"]) == [40, 40]
        assert len(plan.lanes) == 40
        lane = plan.lanes[0]
        assert [c.event for c in lane] == ["enter", "leave", "enter", "leave"]
        assert lane[0].instance_id == lane[1].instance_id != lane[2].instance_id
        assert {c.actor for c in lane} == {"c0"}


async def test_a_storm_round_puts_every_caller_on_one_key_for_m_cycles() -> None:
    """10 callers, 3 cycles: 10 instances of one key, each lane enter/leave three times."""
    engine = Engine(MemoryStore(), timers=False)
    async with engine:
        scenario = CapacityStorm()
        await engine.register(capacity_workflow())
        plan = await scenario.setup(engine, "r1", Params(workers=10, ops=3), random.Random(1))
        assert len(plan.instances) == 10 and plan.extra["keys"] == ["r1-k0"]
        assert all(len(lane) == 6 for lane in plan.lanes)
        assert {c.instance_id for c in plan.lanes[3]} == {"r1-c3-0"}


# -- the figures -----------------------------------------------------------------------------------


def _call(actor: str, event: str, kind: str) -> CallResult:
    return CallResult(CallSpec(f"{actor}-i", event, actor=actor), kind, 0.01, 1)  # type: ignore[arg-type]


def test_fairness_is_over_the_applied_entries_of_the_callers_that_waited() -> None:
    """Jain's index counts only callers refused at least once: here c1 entered twice and c2
    once (c0 never waited); the holders come from the replayed log."""
    results = (
        _call("c0", "enter", "applied"),
        _call("c1", "enter", "applied"),
        _call("c1", "enter", "applied"),
        _call("c2", "enter", "applied"),
        _call("c2", "enter", "refused"),
        _call("c2", "leave", "refused"),
    )
    plan = RoundPlan({}, extra={"keys": ["k"]})
    record = RoundRecord(
        plan,
        results,
        {},
        {},
        {"log": _log("k", [1, 1, -1, -1]), "refusals": {"c1": 2, "c2": 7}, "gave_up": 1},
    )
    figures = CapacityStorm().capacity([record])
    assert figures is not None
    assert figures.jain_fairness == pytest.approx(9 / 10)
    assert figures == CapacityFigures(
        limit=LIMIT,
        keys=1,
        max_holders=2,
        refusals=9,
        gave_up=1,
        waiters=2,
        jain_fairness=figures.jain_fairness,
        log_events=4,
    )


def test_the_json_row_carries_the_capacity_fields() -> None:
    """A capacity result's JSON row has the usual fields and then limit, keys, max_holders,
    refusals, waiters and jain_fairness; other rows have none of them."""
    figures = CapacityFigures(5, 50, 5, 1234, 3, 900, 0.98765, 20000)
    doc = to_json(
        _report(
            _result("optimistic", scenario="capacity-spread", capacity=figures),
            _result("optimistic"),
        )
    )
    row, other = doc["results"]
    assert row["applied_per_s"] == 12.3 and row["verdict"]["ok"] is True
    assert {k: row[k] for k in ("limit", "keys", "max_holders", "refusals", "waiters")} == {
        "limit": 5,
        "keys": 50,
        "max_holders": 5,
        "refusals": 1234,
        "waiters": 900,
    }
    assert row["jain_fairness"] == 0.9877 and row["gave_up"] == 3
    assert "max_holders" not in other


def test_the_terminal_report_has_a_capacity_table() -> None:
    """The capacity pairs get a table of their own, with the holders proved, the refusals and
    Jain's index, which fits 80 columns in one of its forms."""
    figures = CapacityFigures(5, 50, 5, 1234, 3, 900, 0.98765, 20000)
    report = _report(
        _result("raw", scenario="capacity-storm", capacity=figures, floor="counter"),
        _result("optimistic", scenario="capacity-storm", capacity=figures),
    )
    out = io.StringIO()
    render(report, Console(file=out, width=80, force_terminal=False))
    text = out.getvalue()
    assert "capacity: never more holders than the limit" in text
    assert "5 / 5" in text and "1,234" in text and "0.988" in text


def _record(
    log: list[LogRow], histories: dict[str, list[HistoryEntry]], **extra: object
) -> RoundRecord:
    """A round whose instances are held now, one move each (idle -> held)."""
    plan = RoundPlan(dict.fromkeys(histories, "idle"), extra={"keys": ["k"]})
    finals = {
        iid: Instance(id=iid, workflow=WORKFLOW, state=HELD, version=2, data={"key": "k"})
        for iid in histories
    }
    return RoundRecord(plan, (), finals, histories, {"log": log, **extra})


def test_the_engines_rows_are_held_to_flowlocks_constraint_check() -> None:
    """An engine pair's rows go through check_constraints: six takes of a key of capacity 5,
    each with its move in history, fail the round with over-capacity; the same five pass."""
    kind = f"{WORKFLOW}.{HELD}"
    ids = [f"i{n}" for n in range(1, 7)]
    histories = {iid: [_entry(iid, 2, "idle", HELD)] for iid in ids}
    events = tuple(
        SlotEvent(kind, "k", n, iid, 2, 1, n, LIMIT, 1.0) for n, iid in enumerate(ids, start=1)
    )
    slots = tuple(SlotRow(kind, "k", iid, 2) for iid in ids)
    six = ConstraintRows(events, slots, (CounterRow(kind, "k", 6, LIMIT, 6),), ())
    log = [LogRow("k", e.seq, e.instance_id, 1, e.holders) for e in events]
    scenario = CapacitySpread()
    found = scenario.judge(_record(log, histories, rows=six), Params()).violations
    assert OVER_CAPACITY in {v.kind for v in found}
    five = ConstraintRows(events[:5], slots[:5], (CounterRow(kind, "k", 5, LIMIT, 5),), ())
    fewer = {iid: histories[iid] for iid in ids[:5]}
    assert scenario.judge(_record(log[:5], fewer, rows=five), Params()).violations == ()


def test_a_store_without_a_slot_log_fails_the_round() -> None:
    """No slot log read back (no constraint tables): the round is a slot-log violation."""
    record = _record([], {})
    record = RoundRecord(record.plan, (), {}, {}, {"log": None})
    (found,) = CapacityStorm().judge(record, Params()).violations
    assert found.kind == SLOT_LOG and "no slot log" in found.message


def test_with_an_engine_wait_every_caller_counts_for_fairness() -> None:
    """capacity-wait: the engine's waits are not seen from outside, so Jain's index is over
    every caller of the round (here c0 entered twice, c1 never: 0.5)."""
    lanes = (
        (CallSpec("a", "enter", actor="c0"), CallSpec("a", "leave", actor="c0")),
        (CallSpec("b", "enter", actor="c1"), CallSpec("b", "leave", actor="c1")),
    )
    plan = RoundPlan({"a": "idle", "b": "idle"}, lanes=lanes, extra={"keys": ["k"]})
    results = (_call("c0", "enter", "applied"), _call("c0", "enter", "applied"))
    record = RoundRecord(plan, results, {}, {}, {"log": [], "refusals": {"c1": 1}, "gave_up": 1})
    figures = CapacityWait().capacity([record])
    assert figures is not None
    assert figures.waiters == 2 and figures.jain_fairness == pytest.approx(0.5)
