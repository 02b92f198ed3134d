"""Bad data and failing steps are typed errors that change nothing, on every store (memory, SQLite,
PostgreSQL) under the optimistic and the pessimistic strategy.

The cases new users hit: NaN and NUL characters answered StoreError ("retry later") instead of
InvalidInput; an effect returning 2 MB was stored over the 64 KiB limit; an effect returning a
datetime gave a StoreError; an effect raising KeyError let the raw KeyError out. After each refused
call the database is read back with the test's own SQL (not through flowlock): the same version,
data and number of history rows as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

import flowlock
from conftest import BOTH_WAYS
from db_reads import stored
from flowlock.core.jsondata import MAX_DEPTH
from flowlock.core.models import Instance


@pytest.fixture(params=["optimistic", "pessimistic"])
def strategy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(params=BOTH_WAYS)
def batching(request: pytest.FixtureRequest) -> bool:
    """Each test runs with batching on and off (see BOTH_WAYS)."""
    on: bool = request.param
    return on


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


# What an effect returns for payload {"emit": kind}; each is refused before anything is written.
EMITTED: dict[str, Any] = {
    "nan": {"x": float("nan")},
    "infinity": {"x": [1, {"y": float("-inf")}]},
    "nul value": {"note": "a\x00b"},
    "nul key": {"k\x00": 1},
    "datetime": {"at": datetime(2024, 5, 1, tzinfo=UTC)},
    "set": {"tags": {"a", "b"}},
    "int key": {1: "one"},
    "too deep": deep(10_000),
    "2 MB": {"blob": "x" * 2_000_000},
    "integer beyond a double": {"x": -(2**1100)},
}


def emit(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    return EMITTED[payload["emit"]]


def bump(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    return {**inst.data, "count": inst.data["count"] + payload["by"]}


def effect_raises(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    return {"total": inst.data["missing"] + 1}  # KeyError: a bug in the effect


def guard_raises(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    return bool(payload["approver"]["name"])  # KeyError on a payload without "approver"


def guard_flowlock_error(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    # A flowlock error that is no refusal (a nested engine call failing, say) is still the
    # step's failure, not the caller's: StepFailed, with the original as its cause.
    raise flowlock.StoreError("nested call failed")


def lab() -> flowlock.Workflow:
    return flowlock.Workflow(
        "lab",
        states=["open", "closed"],
        initial="open",
        transitions=[
            flowlock.Transition("bump", source="open", target="open", effect=bump),
            flowlock.Transition("emit", source="open", target="open", effect=emit),
            flowlock.Transition("total", source="open", target="open", effect=effect_raises),
            flowlock.Transition("approve", source="open", target="closed", guard=guard_raises),
            flowlock.Transition("odd", source="open", target="closed", guard=guard_flowlock_error),
            flowlock.Transition("close", source="open", target="closed"),
        ],
    )


# What callers pass as create data or fire payload; each is InvalidInput before any I/O.
GIVEN: dict[str, Any] = {
    "nan": {"x": float("nan")},
    "infinity nested": {"x": {"y": [float("inf")]}},
    "nul value": {"note": "a\x00b"},
    "nul key": {"k\x00": 1},
    "nul nested key": {"x": [{"k\x00": 1}]},
    "datetime": {"at": datetime(2024, 5, 1, tzinfo=UTC)},
    "object": {"x": object()},
    "int key": {1: "one"},
    "lone surrogate": {"x": "\udc80"},
    "lone surrogate key": {"\udc80": 1},
    "integer beyond a double": {"x": [2**1100]},
    "10,000 deep": deep(10_000),
    "oversized": {"blob": "x" * 70_000},
}


@pytest.fixture
async def lab_engine(engine: flowlock.Engine) -> flowlock.Engine:
    await engine.register(lab())
    await engine.create("lab", instance_id="i", data={"count": 1})
    # One applied transition first, so "unchanged" covers a history that is not empty.
    await engine.fire("i", "bump", payload={"by": 1})
    return engine


@pytest.mark.parametrize("case", list(GIVEN))
async def test_bad_create_data_is_invalid_input_and_creates_nothing(
    engine: flowlock.Engine, case: str
) -> None:
    await engine.register(lab())
    with pytest.raises(flowlock.InvalidInput) as caught:
        await engine.create("lab", instance_id="new", data=GIVEN[case])
    assert str(caught.value).startswith("data")
    assert await stored(engine, "new") is None


@pytest.mark.parametrize("case", list(GIVEN))
async def test_bad_payload_is_invalid_input_and_writes_nothing(
    lab_engine: flowlock.Engine, strategy: str, case: str
) -> None:
    before = await stored(lab_engine, "i")
    with pytest.raises(flowlock.InvalidInput) as caught:
        await lab_engine.fire("i", "close", payload=GIVEN[case], strategy=strategy)
    assert str(caught.value).startswith("payload")
    assert await stored(lab_engine, "i") == before


@pytest.mark.parametrize("case", list(EMITTED))
async def test_bad_data_from_an_effect_is_invalid_input_and_writes_nothing(
    lab_engine: flowlock.Engine, strategy: str, case: str
) -> None:
    """The effect's data goes through the same check, against the same max_payload_bytes."""
    before = await stored(lab_engine, "i")
    with pytest.raises(flowlock.InvalidInput) as caught:
        await lab_engine.fire("i", "emit", payload={"emit": case}, strategy=strategy)
    message = str(caught.value)
    assert message.startswith("the data the effect of 'emit' returned for instance 'i'")
    if case == "2 MB":
        assert isinstance(caught.value, flowlock.PayloadTooLarge)
        assert caught.value.limit == 64 * 1024 and caught.value.size > 2_000_000
    if case == "too deep":
        assert f"deeper than {MAX_DEPTH}" in message
    assert await stored(lab_engine, "i") == before


@pytest.mark.parametrize(
    ("event", "payload", "step", "cause"),
    [
        ("total", {}, "effect", KeyError),
        ("approve", {}, "guard", KeyError),
        ("odd", {}, "guard", flowlock.StoreError),
    ],
)
async def test_a_step_that_raises_is_step_failed_and_writes_nothing(
    lab_engine: flowlock.Engine,
    strategy: str,
    event: str,
    payload: dict[str, Any],
    step: str,
    cause: type[Exception],
) -> None:
    """StepFailed names the workflow, the event, the instance and the step; the step's own
    exception is its __cause__."""
    before = await stored(lab_engine, "i")
    with pytest.raises(flowlock.StepFailed) as caught:
        await lab_engine.fire("i", event, payload=payload, strategy=strategy)
    failed = caught.value
    assert isinstance(failed.__cause__, cause)
    assert (failed.workflow, failed.event, failed.instance_id, failed.step) == (
        "lab",
        event,
        "i",
        step,
    )
    assert (failed.state, failed.version) == ("open", 2)
    message = str(failed)
    assert f"the {step} of event {event!r} (workflow 'lab')" in message
    assert "instance 'i'" in message and "nothing was written" in message
    assert isinstance(failed, flowlock.FlowlockError)
    assert await stored(lab_engine, "i") == before


async def test_a_good_call_after_the_refusals_still_applies(
    lab_engine: flowlock.Engine, strategy: str
) -> None:
    """Refusals leave no lock, no half-written row: the next call applies as usual."""
    for case in ("nan", "2 MB"):
        with pytest.raises(flowlock.InvalidInput):
            await lab_engine.fire("i", "emit", payload={"emit": case}, strategy=strategy)
    with pytest.raises(flowlock.StepFailed):
        await lab_engine.fire("i", "total", strategy=strategy)
    out = await lab_engine.fire("i", "close", strategy=strategy)
    assert out.applied and out.instance.version == 3
    assert await stored(lab_engine, "i") is not None
