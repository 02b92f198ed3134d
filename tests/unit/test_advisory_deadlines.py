"""The advisory holders' deadline heap: what ran out, the earliest deadline, stale entries."""

from __future__ import annotations

from dataclasses import dataclass

from flowlock.locks.advisory.deadlines import Deadlines


@dataclass(eq=False)
class Item:
    deadline: float


def test_expired_takes_what_ran_out_off_the_books_in_deadline_order() -> None:
    kept = {f"t{i}": Item(float(i)) for i in (5, 1, 3, 2, 4)}
    dates = Deadlines(kept)
    for token, item in kept.items():
        dates.add(token, item)
    assert dates.earliest() == 1.0
    gone = dates.expired(3.0)
    assert [token for token, _ in gone] == ["t1", "t2", "t3"]
    assert sorted(kept) == ["t4", "t5"]
    assert dates.earliest() == 4.0
    assert dates.expired(3.5) == []


def test_a_released_or_renewed_lease_is_not_expired_at_its_old_deadline() -> None:
    a, b, c = Item(1.0), Item(2.0), Item(3.0)
    kept = {"a": a, "b": b, "c": c}
    dates = Deadlines(kept)
    for token, item in kept.items():
        dates.add(token, item)
    del kept["a"]  # released
    b.deadline = 10.0  # renewed
    dates.add("b", b)
    assert dates.earliest() == 3.0
    assert dates.earliest(skip={id(c)}) == 10.0
    assert dates.earliest() == 3.0  # what was skipped is still there
    assert [token for token, _ in dates.expired(5.0)] == ["c"]
    assert [token for token, _ in dates.expired(10.0)] == ["b"]
    assert kept == {}
    dates.clear()
    assert dates.earliest() == float("inf")


def test_stale_entries_do_not_pile_up() -> None:
    item = Item(0.0)
    kept = {"x": item}
    dates = Deadlines(kept)
    for n in range(10_000):  # a lease renewed many times
        item.deadline = float(n)
        dates.add("x", item)
    assert len(dates._heap) <= 2 * len(kept) + 65
    assert dates.earliest() == 9999.0
