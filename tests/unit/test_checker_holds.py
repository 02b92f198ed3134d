"""The holds check: a hold of an id that does not exist is fine; a hold with no id, one id held
twice, or a hold without its time is `malformed-hold`. `check_instances` (`flowlock check`)
runs it over every hold of the store."""

from __future__ import annotations

from datetime import UTC, datetime

import flowlock
from flowlock._inspect import check_instances
from flowlock.checker import KINDS, MALFORMED_HOLD, check_holds
from flowlock.core.retention import Hold
from flowlock.stores import MemoryStore

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_well_formed_holds_are_clean_whether_or_not_their_instance_exists() -> None:
    assert check_holds([Hold("a", "case 1", "legal", NOW), Hold("gone", None, None, NOW)]) == []


def test_malformed_holds_are_reported() -> None:
    found = check_holds([Hold("", at=NOW), Hold("a", at=NOW), Hold("a", at=NOW), Hold("b")])
    assert [v.kind for v in found] == [MALFORMED_HOLD] * 3
    assert "no instance id" in found[0].message
    assert "held twice" in found[1].message
    assert "no time" in found[2].message
    assert MALFORMED_HOLD in KINDS


async def test_check_counts_the_holds_of_a_store() -> None:
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(flowlock.examples.approval())
        await engine.create("approval", instance_id="a")
        await engine.hold("a", reason="case 9")
        await engine.hold("not-made-yet")
        report = await check_instances(engine, None)
    assert report.verdict.ok and (report.instances, report.holds) == (1, 2)
