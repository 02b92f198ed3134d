"""The constraint check on hand-made rows: a clean trail passes, and each way a trail can lie
(a gap, a count, a take over the limit, a leaked or missing slot, an event with no commit, a
rate window over its limit) is caught as its own kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta

import flowlock
from flowlock._inspect import check_instances
from flowlock.checker import (
    KINDS,
    LEAKED_SLOT,
    MISSING_SLOT,
    ORPHAN_CONSTRAINT_EVENT,
    OVER_CAPACITY,
    OVER_RATE,
    SLOT_COUNTER,
    SLOT_LOG,
    Violation,
)
from flowlock.checker.constraints import SlotRule, check_constraints, rules_of, slot_rules
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.versions import canonical
from flowlock.stores import MemoryStore
from flowlock.stores.constraint_store import (
    ConstraintRows,
    CounterRow,
    RateEvent,
    SlotEvent,
    SlotRow,
)

KIND = "review.in_review"
RATE = "review.start.rate"
RULES = {
    "review": [SlotRule(KIND, frozenset({"in_review"}), key=lambda inst: inst.data["reviewer"])]
}


def _inst(id_: str, state: str, version: int, reviewer: str = "r") -> Instance:
    return Instance(id_, "review", state, version, {"reviewer": reviewer})


def _row(id_: str, version: int, src: str, dst: str, event: str) -> HistoryEntry:
    return HistoryEntry(id_, version, event, src, dst, None, None, "optimistic", {"reviewer": "r"})


def _take(seq: int, id_: str, version: int, holders: int, limit: int = 2) -> SlotEvent:
    return SlotEvent(KIND, "r", seq, id_, version, 1, holders, limit, float(seq))


def _release(seq: int, id_: str, version: int, holders: int) -> SlotEvent:
    return SlotEvent(KIND, "r", seq, id_, version, -1, holders, 2, float(seq))


def _rate(id_: str, at: float, version: int = 2, limit: int = 2) -> RateEvent:
    return RateEvent(RATE, "r", id_, version, at, limit, 60.0)


# a: created (queued), started (in_review, v2), finished (done, v3).
# b and c: created, started. Capacity 2 per reviewer; starts rate-limited to 2 a minute.
INSTANCES = [_inst("a", "done", 3), _inst("b", "in_review", 2), _inst("c", "in_review", 2)]
HISTORY = [
    _row("a", 2, "queued", "in_review", "start"),
    _row("a", 3, "in_review", "done", "finish"),
    _row("b", 2, "queued", "in_review", "start"),
    _row("c", 2, "queued", "in_review", "start"),
]
CLEAN = ConstraintRows(
    log=(_take(1, "a", 2, 1), _take(2, "b", 2, 2), _release(3, "a", 3, 1), _take(4, "c", 2, 2)),
    slots=(SlotRow(KIND, "r", "b", 2), SlotRow(KIND, "r", "c", 2)),
    counters=(CounterRow(KIND, "r", 2, 2, 4),),
    rates=(_rate("a", 0.0), _rate("b", 30.0), _rate("c", 61.0)),
)


def _check(
    rows: ConstraintRows,
    instances: Sequence[Instance] = INSTANCES,
    history: Sequence[HistoryEntry] = HISTORY,
    *,
    current: bool = True,
) -> list[Violation]:
    return check_constraints(rows, instances, history, RULES, current=current)


def _kinds(found: list[Violation]) -> list[str]:
    return sorted(v.kind for v in found)


def test_a_clean_trail_passes() -> None:
    """Rows that add up, slots held in their states, windows within the limit: no violation."""
    assert _check(CLEAN) == []
    assert check_constraints(CLEAN, INSTANCES, HISTORY) == []  # no rules known: fewer checks


def test_the_new_kinds_are_kinds_of_the_check() -> None:
    """Every constraint violation kind is listed with the others."""
    new = {SLOT_LOG, OVER_CAPACITY, SLOT_COUNTER, LEAKED_SLOT, MISSING_SLOT, OVER_RATE}
    assert new | {ORPHAN_CONSTRAINT_EVENT} <= set(KINDS)


def test_a_gap_in_a_keys_numbering_is_a_slot_log_violation() -> None:
    """Events numbered 1, 2, 3, 5: one missing event, reported once."""
    log = (*CLEAN.log[:3], dataclasses.replace(CLEAN.log[3], seq=5))
    rows = dataclasses.replace(CLEAN, log=log, counters=(CounterRow(KIND, "r", 2, 2, 5),))
    found = _check(rows)
    assert _kinds(found) == [SLOT_LOG]
    assert "5 where 4 was due" in found[0].message


def test_a_holder_count_that_does_not_add_up_is_a_slot_log_violation() -> None:
    """An event whose holder count is not the running sum of takes and releases."""
    log = (CLEAN.log[0], dataclasses.replace(CLEAN.log[1], holders=1), *CLEAN.log[2:])
    found = _check(dataclasses.replace(CLEAN, log=log))
    assert _kinds(found) == [SLOT_LOG]
    assert "says 1 holder(s), its events add up to 2" in found[0].message


def test_a_release_of_a_slot_not_held_is_a_slot_log_violation() -> None:
    """A release by an instance that took nothing."""
    log = (*CLEAN.log, _release(5, "a", 3, 1))
    rows = dataclasses.replace(CLEAN, log=log, counters=(CounterRow(KIND, "r", 1, 2, 5),))
    found = _check(rows)
    assert SLOT_LOG in _kinds(found)
    assert any("released a slot it did not hold" in v.message for v in found)


def test_a_take_over_the_limit_is_over_capacity() -> None:
    """A third holder of a key of limit 2, however consistent the rest of the rows."""
    instances = [*INSTANCES, _inst("d", "in_review", 2)]
    history = [*HISTORY, _row("d", 2, "queued", "in_review", "start")]
    rows = dataclasses.replace(
        CLEAN,
        log=(*CLEAN.log, _take(5, "d", 2, 3)),
        slots=(*CLEAN.slots, SlotRow(KIND, "r", "d", 2)),
        counters=(CounterRow(KIND, "r", 3, 2, 5),),
    )
    found = _check(rows, instances, history)
    assert _kinds(found) == [OVER_CAPACITY]
    assert "left 3 holders, over the limit of 2" in found[0].message
    assert found[0].version == 2


def test_a_counter_that_disagrees_with_the_events_is_a_slot_counter_violation() -> None:
    """The counter says one holder where the events leave two."""
    rows = dataclasses.replace(CLEAN, counters=(CounterRow(KIND, "r", 1, 2, 4),))
    found = _check(rows)
    assert _kinds(found) == [SLOT_COUNTER]
    assert "counter says 1 holder(s)" in found[0].message


def test_events_without_a_counter_row_are_a_slot_counter_violation() -> None:
    """A key with events has a counter row."""
    found = _check(dataclasses.replace(CLEAN, counters=()))
    assert _kinds(found) == [SLOT_COUNTER]
    assert "no counter row" in found[0].message


def test_a_rate_limits_counter_row_holds_no_slot() -> None:
    """A store may count a rate key's applications on a counter row of its own: any sequence
    number, never a holder."""
    counter = CounterRow(RATE, "r", 0, 2, 3)
    assert _check(dataclasses.replace(CLEAN, counters=(*CLEAN.counters, counter))) == []
    held = dataclasses.replace(counter, holders=1)
    found = _check(dataclasses.replace(CLEAN, counters=(*CLEAN.counters, held)))
    assert _kinds(found) == [SLOT_COUNTER]


def test_a_slot_row_the_events_do_not_leave_is_a_slot_counter_violation() -> None:
    """Slot rows are the replayed holders: a missing one shows (and so does the instance in the
    state without its slot)."""
    found = _check(dataclasses.replace(CLEAN, slots=CLEAN.slots[:1]))
    assert _kinds(found) == [MISSING_SLOT, SLOT_COUNTER]
    assert "no slot row of 'c'" in next(v for v in found if v.kind == SLOT_COUNTER).message


def test_a_slot_kept_after_leaving_the_state_is_leaked() -> None:
    """a finished (done) but its release was never written: its slot leaked."""
    rows = ConstraintRows(
        log=(_take(1, "a", 2, 1, 5), _take(2, "b", 2, 2, 5), _take(3, "c", 2, 3, 5)),
        slots=(*CLEAN.slots, SlotRow(KIND, "r", "a", 2)),
        counters=(CounterRow(KIND, "r", 3, 5, 3),),
        rates=(),
    )
    found = _check(rows)
    assert _kinds(found) == [LEAKED_SLOT]
    assert "'a'" in found[0].message and "'done'" in found[0].message
    assert _check(rows, current=False) == []  # the instances may have moved since the rows


def test_a_slot_of_an_instance_that_does_not_exist_is_leaked() -> None:
    """A slot held by an instance gone (a purge that kept it); its events are not judged."""
    rows = dataclasses.replace(
        CLEAN,
        log=(*CLEAN.log, _release(5, "c", 3, 1), _take(6, "ghost", 4, 2)),
        slots=(CLEAN.slots[0], SlotRow(KIND, "r", "ghost", 4)),
        counters=(CounterRow(KIND, "r", 2, 2, 6),),
    )
    instances = [*INSTANCES[:2], _inst("c", "done", 3)]
    history = [*HISTORY, _row("c", 3, "in_review", "done", "finish")]
    found = _check(rows, instances, history)
    assert _kinds(found) == [LEAKED_SLOT]
    assert "no such instance exists" in found[0].message


def test_two_slots_of_one_kind_are_leaked() -> None:
    """An instance holds at most one slot of a kind."""
    other = SlotEvent(KIND, "s", 1, "b", 2, 1, 1, 2, 9.0)
    rows = dataclasses.replace(
        CLEAN,
        log=(*CLEAN.log, other),
        slots=(*CLEAN.slots, SlotRow(KIND, "s", "b", 2)),
        counters=(*CLEAN.counters, CounterRow(KIND, "s", 1, 2, 1)),
    )
    found = _check(rows)
    assert LEAKED_SLOT in _kinds(found)
    assert any("holds 2 slots" in v.message for v in found)


def test_a_take_into_a_state_without_the_rule_is_leaked() -> None:
    """A slot taken by a commit that left the instance in a state no rule of its kind holds."""
    rows = dataclasses.replace(
        CLEAN,
        log=(*CLEAN.log, _release(5, "c", 2, 1), _take(6, "a", 3, 2)),
        slots=(CLEAN.slots[0], SlotRow(KIND, "r", "a", 3)),
        counters=(CounterRow(KIND, "r", 2, 2, 6),),
    )
    found = _check(rows, current=False)
    assert _kinds(found) == [LEAKED_SLOT]
    assert "which left it in 'done'" in found[0].message


def test_an_event_with_no_commit_is_an_orphan() -> None:
    """A slot event names a version its instance's history lacks; a rate is never counted by a
    create (version 1)."""
    log = (*CLEAN.log[:3], dataclasses.replace(CLEAN.log[3], version=7))
    rows = dataclasses.replace(CLEAN, log=log, slots=(CLEAN.slots[0], SlotRow(KIND, "r", "c", 7)))
    found = _check(rows)
    assert _kinds(found) == [ORPHAN_CONSTRAINT_EVENT]
    assert found[0].version == 7
    rates = dataclasses.replace(CLEAN, rates=(*CLEAN.rates, _rate("a", 500.0, version=1)))
    assert _kinds(_check(rates)) == [ORPHAN_CONSTRAINT_EVENT]


def test_an_instance_in_a_state_without_its_slot_is_missing_one() -> None:
    """c is in review but took no slot (its take and slot row never written)."""
    rows = dataclasses.replace(
        CLEAN, log=CLEAN.log[:3], slots=CLEAN.slots[:1], counters=(CounterRow(KIND, "r", 1, 2, 3),)
    )
    found = _check(rows)
    assert _kinds(found) == [MISSING_SLOT]
    assert "'c'" in found[0].message and "holds no slot" in found[0].message


def test_a_slot_of_another_key_is_missing_one() -> None:
    """c's key is now "s" but it holds a slot of "r": it should have moved with the key."""
    instances = [*INSTANCES[:2], _inst("c", "in_review", 2, reviewer="s")]
    found = _check(CLEAN, instances)
    assert _kinds(found) == [MISSING_SLOT]
    assert "a slot of key 'r'" in found[0].message


def test_a_key_none_is_exempt() -> None:
    """An instance whose key is None holds no slot, and needs none."""
    rules = {"review": [SlotRule(KIND, frozenset({"in_review"}), key=lambda inst: None)]}
    rows = ConstraintRows((), (), (), ())
    assert check_constraints(rows, INSTANCES, HISTORY, rules) == []


def test_too_many_applications_in_a_window_are_over_rate() -> None:
    """Three starts of one key within 60 s, limit 2: the third is over."""
    rows = dataclasses.replace(CLEAN, rates=(_rate("a", 0.0), _rate("b", 30.0), _rate("c", 59.0)))
    found = _check(rows)
    assert _kinds(found) == [OVER_RATE]
    assert "'c'" in found[0].message and "3th within 60 s" in found[0].message


def test_applications_a_whole_window_apart_are_within_the_rate() -> None:
    """An application exactly `per` seconds after another no longer counts it."""
    rows = dataclasses.replace(CLEAN, rates=(_rate("a", 0.0), _rate("b", 0.0), _rate("c", 60.0)))
    assert _check(rows) == []


def test_each_application_is_held_to_the_limit_it_was_counted_under() -> None:
    """A limit raised to 3 later lets a third in; the earlier limit of 2 judged the earlier."""
    rates = (_rate("a", 0.0), _rate("b", 10.0), _rate("c", 20.0, limit=3))
    assert _check(dataclasses.replace(CLEAN, rates=rates)) == []


def test_rules_come_from_a_registered_workflow_or_a_stored_definition() -> None:
    """A workflow's capacity and unique rules, with keys when registered; from its canonical
    form without; an instance of a version not stored takes every version's states."""

    def reviewer(inst: Instance) -> str:
        return str(inst.data["reviewer"])

    per_minute = flowlock.Rate(key=reviewer, per=timedelta(minutes=1), limit=5)
    wf = flowlock.Workflow(
        "review",
        states=["queued", flowlock.State("in_review", capacity=flowlock.Capacity(
            key=reviewer, limit=2)), "done"],
        initial="queued",
        transitions=[
            flowlock.Transition("start", source="queued", target="in_review", rate=per_minute),
            flowlock.Transition("finish", source="in_review", target="done"),
        ],
        unique=flowlock.Unique(key=reviewer, states=["queued"]),
    )  # fmt: skip
    registered = slot_rules(wf)
    assert {(r.kind, r.states, r.key is not None) for r in registered} == {
        (KIND, frozenset({"in_review"}), True),
        ("review.unique", frozenset({"queued"}), True),
    }
    stored = slot_rules(canonical(wf))
    assert {(r.kind, r.states, r.key) for r in stored} == {
        (KIND, frozenset({"in_review"}), None),
        ("review.unique", frozenset({"queued"}), None),
    }
    rules = rules_of({"review": {1: canonical(wf)}})
    assert rules(_inst("a", "done", 3)) == stored
    unknown = rules(dataclasses.replace(_inst("a", "done", 3), definition_version=9))
    assert {r.kind for r in unknown or ()} == {KIND, "review.unique"}
    assert rules(Instance("x", "other", "s", 1, {})) is None
    assert rules_of({}, lambda name, version: wf)(_inst("a", "done", 3)) == registered


async def test_check_on_a_store_without_constraints_counts_no_events() -> None:
    """`flowlock check` reads constraints only from a store that keeps them."""
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(flowlock.examples.approval())
        await engine.create("approval", instance_id="a")
        report = await check_instances(engine, None)
    assert report.verdict.ok
    if not isinstance(engine.store, flowlock.stores.constraint_store.ConstraintStore):
        assert (report.slot_events, report.rate_events) == (0, 0)
