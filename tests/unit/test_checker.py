"""Unit tests for flowlock.checker: valid histories pass, each kind of breakage is caught."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowlock.checker import (
    BROKEN_CHAIN,
    DOUBLE_APPLY,
    FINAL_MISMATCH,
    FOREIGN_ENTRY,
    INVARIANT,
    LOST_UPDATE,
    OVERSELL,
    VERSION_GAP,
    CheckFailed,
    Verdict,
    Violation,
    check,
    check_many,
)
from flowlock.core.errors import FlowlockError
from flowlock.core.models import HistoryEntry, Instance

STATES = ("new", "paid", "shipped", "done")


def make_chain(
    steps: Sequence[tuple[str, str, int]],
    *,
    instance_id: str = "i-1",
    initial: str = "new",
) -> tuple[Instance, list[HistoryEntry]]:
    """A valid (instance, history) from (event, to_state, stock) steps."""
    history: list[HistoryEntry] = []
    state = initial
    data: Mapping[str, Any] = {"stock": 10}
    for n, (event, to_state, stock) in enumerate(steps):
        data = {"stock": stock}
        history.append(
            HistoryEntry(
                instance_id=instance_id,
                version=n + 2,
                event=event,
                from_state=state,
                to_state=to_state,
                actor=None,
                request_id=f"req-{n}",
                strategy="optimistic",
                data=data,
            )
        )
        state = to_state
    instance = Instance(
        id=instance_id,
        workflow="order",
        state=state,
        version=1 + len(history),
        data=data,
        last_event=history[-1].event if history else None,
    )
    return instance, history


def order() -> tuple[Instance, list[HistoryEntry]]:
    """A four-step valid order history."""
    return make_chain(
        [("pay", "paid", 9), ("ship", "shipped", 8), ("deliver", "done", 7), ("note", "done", 7)]
    )


def stock_ok(data: Mapping[str, Any]) -> str | None:
    """Invariant: stock never negative."""
    stock = data["stock"]
    return f"stock below zero: {stock}" if stock < 0 else None


def kinds(verdict: Verdict) -> list[str]:
    """The kinds of a verdict's violations, in order."""
    return [v.kind for v in verdict.violations]


def test_valid_history_passes() -> None:
    """A correct history with every optional check on yields an ok, empty verdict."""
    instance, history = order()
    verdict = check(instance, history, initial_state="new", expected_applied=4, invariant=stock_ok)
    assert verdict.ok
    assert verdict
    assert verdict.violations == ()
    assert verdict.to_dict() == {"ok": True, "violations": []}
    verdict.raise_for_violations()


def test_fresh_instance_without_history_passes() -> None:
    """An instance at version 1 with no history is valid."""
    instance, history = make_chain([])
    assert check(instance, history, initial_state="new", expected_applied=0, invariant=stock_ok)


def test_gap_in_versions() -> None:
    """A missing middle row is a version-gap at the missing version."""
    instance, history = order()
    del history[1]
    verdict = check(instance, history)
    assert not verdict
    gaps = [v for v in verdict.violations if v.kind == VERSION_GAP]
    assert [v.version for v in gaps] == [3]
    assert "missing" in gaps[0].message


def test_duplicated_version() -> None:
    """Two rows with the same version are a version-gap."""
    instance, history = order()
    history[2] = dataclasses.replace(history[2], version=3, request_id="other")
    verdict = check(instance, history)
    assert VERSION_GAP in kinds(verdict)
    assert any("more than once" in v.message for v in verdict.violations)


def test_out_of_order_versions() -> None:
    """Rows given out of version order are a version-gap."""
    instance, history = order()
    history[1], history[2] = history[2], history[1]
    verdict = check(instance, history)
    assert kinds(verdict) == [VERSION_GAP]
    assert "out of order" in verdict.violations[0].message


def test_duplicated_request_id() -> None:
    """The same request_id on two rows is a double-apply."""
    instance, history = order()
    history[3] = dataclasses.replace(history[3], request_id=history[1].request_id)
    verdict = check(instance, history)
    assert kinds(verdict) == [DOUBLE_APPLY]
    assert verdict.violations[0].version == 5


def test_null_request_ids_may_repeat() -> None:
    """Rows without a request_id are never a double-apply."""
    instance, history = order()
    history = [dataclasses.replace(e, request_id=None) for e in history]
    assert check(instance, history)


def test_broken_chain() -> None:
    """A row not starting where the previous ended is a broken-chain."""
    instance, history = order()
    history[2] = dataclasses.replace(history[2], from_state="new")
    verdict = check(instance, history)
    assert kinds(verdict) == [BROKEN_CHAIN]
    assert verdict.violations[0].version == 4


def test_first_row_not_from_initial_state() -> None:
    """The first row must start in initial_state when it is given."""
    instance, history = order()
    history[0] = dataclasses.replace(history[0], from_state="paid")
    assert check(instance, history)
    assert kinds(check(instance, history, initial_state="new")) == [BROKEN_CHAIN]


def test_final_version_mismatch() -> None:
    """An instance version not equal to 1 + len(history) is a final-mismatch."""
    instance, history = order()
    verdict = check(instance.evolve(version=6), history)
    assert kinds(verdict) == [FINAL_MISMATCH]
    assert verdict.violations[0].version == 6


def test_final_state_mismatch() -> None:
    """A final state other than the last row's to_state is a final-mismatch."""
    instance, history = order()
    verdict = check(instance.evolve(state="shipped"), history)
    assert kinds(verdict) == [FINAL_MISMATCH]
    assert "'shipped'" in verdict.violations[0].message


def test_final_data_and_last_event_mismatch() -> None:
    """Final data or last_event other than the last row's are each a final-mismatch."""
    instance, history = order()
    verdict = check(instance.evolve(data={"stock": 3}, last_event="ship"), history)
    assert kinds(verdict) == [FINAL_MISMATCH, FINAL_MISMATCH]


def test_empty_history_with_moved_instance() -> None:
    """An instance that moved but has no history is a final-mismatch."""
    instance, _ = order()
    assert set(kinds(check(instance, [], initial_state="new"))) == {FINAL_MISMATCH}


def test_lost_update_via_expected_applied() -> None:
    """Fewer rows than calls reported applied is a lost-update."""
    instance, history = order()
    verdict = check(instance, history, expected_applied=5)
    assert kinds(verdict) == [LOST_UPDATE]
    assert "1 lost" in verdict.violations[0].message


def test_double_apply_via_expected_applied() -> None:
    """More rows than calls reported applied is a double-apply."""
    instance, history = order()
    verdict = check(instance, history, expected_applied=3)
    assert kinds(verdict) == [DOUBLE_APPLY]


def test_foreign_entry() -> None:
    """A row for another instance is a foreign-entry and is left out of other checks."""
    instance, history = order()
    stray = dataclasses.replace(history[0], instance_id="i-2", version=6)
    verdict = check(instance, [*history, stray])
    assert kinds(verdict) == [FOREIGN_ENTRY]


def test_invariant_violation() -> None:
    """An invariant failing after a row is reported at that row, with its message."""
    instance, history = make_chain([("buy", "paid", 0), ("buy", "paid", -1), ("fix", "done", 0)])
    verdict = check(instance, history, invariant=stock_ok)
    assert kinds(verdict) == [INVARIANT]
    assert verdict.violations[0].version == 3
    assert "stock below zero: -1" in verdict.violations[0].message


def test_invariant_on_final_instance_and_custom_kind() -> None:
    """The invariant also runs on a final instance whose data differs; the kind can be set."""
    instance, history = make_chain([("buy", "paid", 1)])
    verdict = check(
        instance.evolve(data={"stock": -2}), history, invariant=stock_ok, invariant_kind=OVERSELL
    )
    assert kinds(verdict) == [FINAL_MISMATCH, OVERSELL]
    assert "stock below zero: -2" in verdict.violations[1].message


def test_multiple_violations_all_reported() -> None:
    """Every violation is reported, not just the first."""
    instance, history = order()
    history[3] = dataclasses.replace(history[3], request_id=history[0].request_id)
    history[2] = dataclasses.replace(history[2], from_state="new", data={"stock": -5})
    del history[1]
    bad = instance.evolve(state="paid")
    verdict = check(bad, history, initial_state="new", expected_applied=4, invariant=stock_ok)
    assert set(kinds(verdict)) == {
        VERSION_GAP,
        DOUBLE_APPLY,
        BROKEN_CHAIN,
        FINAL_MISMATCH,
        LOST_UPDATE,
        INVARIANT,
    }


def test_verdict_to_dict_is_json_shape() -> None:
    """to_dict gives the benchmark's JSON shape."""
    instance, history = order()
    payload = check(instance, history, expected_applied=5).to_dict()
    assert json.loads(json.dumps(payload)) == payload
    assert payload["ok"] is False
    assert list(payload["violations"][0]) == ["kind", "message", "version"]
    assert payload["violations"][0]["kind"] == LOST_UPDATE
    assert payload["violations"][0]["version"] is None


def test_raise_for_violations() -> None:
    """raise_for_violations raises CheckFailed, a FlowlockError, listing each violation."""
    instance, history = order()
    verdict = check(instance.evolve(version=9), history, expected_applied=2)
    with pytest.raises(CheckFailed) as info:
        verdict.raise_for_violations()
    assert isinstance(info.value, FlowlockError)
    assert info.value.verdict is verdict
    text = str(info.value)
    assert "2 violation(s)" in text
    assert "[final-mismatch]" in text
    assert "[double-apply]" in text


def test_verdict_must_be_consistent() -> None:
    """A verdict cannot be ok with violations, nor failing without any."""
    with pytest.raises(ValueError, match="inconsistent"):
        Verdict(ok=True, violations=(Violation(VERSION_GAP, "x"),))
    with pytest.raises(ValueError, match="inconsistent"):
        Verdict(ok=False, violations=())


def test_check_many_merges_verdicts() -> None:
    """check_many merges per-instance verdicts; messages name the instance."""
    good = make_chain([("pay", "paid", 9)], instance_id="a")
    bad_instance, bad_history = make_chain([("pay", "paid", 9)], instance_id="b")
    assert check_many([good, good], expected_applied=1)
    verdict = check_many(
        [good, (bad_instance.evolve(version=5), bad_history)], expected_applied={"a": 1, "b": 2}
    )
    assert kinds(verdict) == [LOST_UPDATE, FINAL_MISMATCH]
    assert all("'b'" in v.message for v in verdict.violations)


steps_strategy = st.lists(
    st.tuples(
        st.sampled_from(("pay", "ship", "note", "refund")),
        st.sampled_from(STATES),
        st.integers(min_value=0, max_value=100),
    ),
    min_size=1,
    max_size=20,
)


@given(steps=steps_strategy)
def test_property_valid_chain_passes(steps: list[tuple[str, str, int]]) -> None:
    """Any generated valid chain passes every check."""
    instance, history = make_chain(steps)
    verdict = check(
        instance, history, initial_state="new", expected_applied=len(history), invariant=stock_ok
    )
    assert verdict.ok, verdict.describe()


@given(steps=steps_strategy, data=st.data())
def test_property_dropping_an_entry_fails(
    steps: list[tuple[str, str, int]], data: st.DataObject
) -> None:
    """Dropping any one entry of a valid chain always fails."""
    instance, history = make_chain(steps)
    i = data.draw(st.integers(min_value=0, max_value=len(history) - 1))
    del history[i]
    assert not check(instance, history)


@given(steps=steps_strategy, data=st.data())
def test_property_duplicating_an_entry_fails(
    steps: list[tuple[str, str, int]], data: st.DataObject
) -> None:
    """Duplicating any one entry of a valid chain, anywhere, always fails."""
    instance, history = make_chain(steps)
    i = data.draw(st.integers(min_value=0, max_value=len(history) - 1))
    j = data.draw(st.integers(min_value=0, max_value=len(history)))
    history.insert(j, history[i])
    verdict = check(instance, history)
    assert not verdict
    assert VERSION_GAP in verdict.kinds()
