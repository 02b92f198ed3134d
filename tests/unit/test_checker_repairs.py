"""The exactly-once check's repair rules: forced rows are transitions of their own kind, pause
and resume rows keep state and data, and no fired row lands while the instance is paused."""

from __future__ import annotations

from typing import Any

import flowlock
from flowlock.checker import check
from flowlock.checker.verdicts import FINAL_MISMATCH, FIRED_WHILE_PAUSED, KINDS, REPAIR_ROW
from flowlock.core.admin import FORCE_EVENT, PAUSE_EVENT, RESUME_EVENT
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores import MemoryStore


def row(
    version: int,
    event: str,
    src: str,
    dst: str,
    data: dict[str, Any] | None = None,
    payload: dict[str, Any] | None = None,
) -> HistoryEntry:
    return HistoryEntry(
        "i", version, event, src, dst, "ops", None, "optimistic", data or {}, payload=payload or {}
    )


def inst(rows: list[HistoryEntry], *, paused: bool = False) -> Instance:
    last = rows[-1]
    return Instance(
        "i", "approval", last.to_state, last.version, last.data, last.event, paused=paused
    )


def kinds(rows: list[HistoryEntry], *, paused: bool = False) -> list[str]:
    return [v.kind for v in check(inst(rows, paused=paused), rows).violations]


def test_the_new_kinds_are_listed() -> None:
    assert {FIRED_WHILE_PAUSED, REPAIR_ROW} <= set(KINDS)


def test_a_forced_row_goes_anywhere() -> None:
    given = {"reason": "r", "state": "gone", "data": {"x": 1}}
    rows = [
        row(2, "approve", "pending", "approved"),
        row(3, FORCE_EVENT, "approved", "pending", payload={"reason": "r", "state": "pending"}),
        row(4, FORCE_EVENT, "pending", "gone", {"x": 1}, given),
    ]
    assert kinds(rows) == []


def test_a_forced_row_without_reason_or_elsewhere_is_flagged() -> None:
    rows = [
        row(2, FORCE_EVENT, "pending", "approved", payload={"state": "approved"}),
        row(3, FORCE_EVENT, "approved", "rejected", payload={"reason": "r", "state": "pending"}),
    ]
    assert kinds(rows) == [REPAIR_ROW, REPAIR_ROW]


def test_pause_and_resume_keep_state_and_data() -> None:
    good = [
        row(2, "approve", "pending", "approved", {"a": 1}),
        row(3, PAUSE_EVENT, "approved", "approved", {"a": 1}, {"reason": "audit"}),
        row(4, RESUME_EVENT, "approved", "approved", {"a": 1}),
    ]
    assert kinds(good) == []
    moved = [row(2, PAUSE_EVENT, "pending", "approved", payload={"reason": "r"})]
    assert kinds(moved, paused=True) == [REPAIR_ROW]
    changed = [
        row(2, "approve", "pending", "approved", {"a": 1}),
        row(3, PAUSE_EVENT, "approved", "approved", {"a": 2}, {"reason": "r"}),
    ]
    assert kinds(changed, paused=True) == [REPAIR_ROW]


def test_a_pause_twice_or_a_resume_of_nothing_is_flagged() -> None:
    twice = [
        row(2, PAUSE_EVENT, "pending", "pending", payload={"reason": "r"}),
        row(3, PAUSE_EVENT, "pending", "pending", payload={"reason": "r"}),
    ]
    assert kinds(twice, paused=True) == [REPAIR_ROW]
    assert kinds([row(2, RESUME_EVENT, "pending", "pending")]) == [REPAIR_ROW]


def test_a_fire_while_paused_is_flagged() -> None:
    rows = [
        row(2, PAUSE_EVENT, "pending", "pending", payload={"reason": "r"}),
        row(3, "approve", "pending", "approved"),
        row(4, RESUME_EVENT, "approved", "approved"),
        row(5, "reopen", "approved", "pending"),
    ]
    assert kinds(rows) == [FIRED_WHILE_PAUSED]


def test_the_stored_pause_must_match_the_history() -> None:
    rows = [row(2, PAUSE_EVENT, "pending", "pending", payload={"reason": "r"})]
    assert kinds(rows, paused=True) == []
    assert kinds(rows, paused=False) == [FINAL_MISMATCH]
    assert kinds([row(2, "approve", "pending", "approved")], paused=True) == [FINAL_MISMATCH]


async def test_the_engine_writes_what_the_check_accepts() -> None:
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(flowlock.examples.approval())
        await engine.create("approval", instance_id="e")
        await engine.pause("e", reason="look", actor="ops")
        await engine.force("e", "approved", data={"k": 1}, reason="fix", actor="ops")
        await engine.resume("e", actor="ops")
        await engine.force("e", "pending", reason="again", actor="ops")
        await engine.fire("e", "reject")
        await engine.pause("e", reason="hold")
        verdict = check(await engine.get("e"), await engine.history("e"), initial_state="pending")
        assert verdict.ok, verdict.violations
