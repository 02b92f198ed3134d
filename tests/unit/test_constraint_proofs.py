"""The cross-process constraint tests' own proofs (tests/constraint_kit.py) find what they are
for: a clean log passes, and a key over its limit, a gap in the seqs, a counter or a slot row
that disagrees with the log, an instance in the state without a slot, or a rate window over
its limit each fails, named."""

from __future__ import annotations

from typing import Any

from constraint_kit import REVIEW_KIND, Rows, rate_proof, slot_proof

K = REVIEW_KIND


def _rows(**given: Any) -> Rows:
    """Two reviews of ann in review (r1, r2) and r3 in and out: a clean story."""
    base: dict[str, Any] = {
        "log": [
            (K, "ann", 1, "r1", 2, 1, 1, 5),
            (K, "ann", 2, "r3", 2, 1, 2, 5),
            (K, "ann", 3, "r2", 2, 1, 3, 5),
            (K, "ann", 4, "r3", 3, -1, 2, 5),
        ],
        "slots": [(K, "ann", "r1", 2), (K, "ann", "r2", 2)],
        "counters": [(K, "ann", 2, 5, 4)],
        "instances": [
            ("r1", "review", "in_review", 2, {"reviewer": "ann"}),
            ("r2", "review", "in_review", 2, {"reviewer": "ann"}),
            ("r3", "review", "queued", 3, {"reviewer": "ann"}),
        ],
        "history": [
            ("r1", 2, "start", "p0"),
            ("r2", 2, "start", "p1"),
            ("r3", 2, "start", "p0"),
            ("r3", 3, "finish", "p1"),
        ],
        "rates": [],
    }
    return Rows(**{**base, **given})


def _problems(rows: Rows, limit: int = 5) -> list[str]:
    return slot_proof(rows, K, limit, key_of=lambda d: d["reviewer"]).problems


def test_a_clean_log_passes() -> None:
    """The clean story replays to 2 holders, a peak of 3, with no problem."""
    proof = slot_proof(_rows(), K, 5, key_of=lambda d: d["reviewer"])
    assert proof.problems == []
    assert (proof.peak, proof.holders, proof.takes) == ({"ann": 3}, {"ann": 2}, 3)


def test_a_key_over_its_limit_fails() -> None:
    """With a limit of 2 the third take is over it."""
    assert any("3 holders, limit 2" in p for p in _problems(_rows(), limit=2))


def test_a_full_key_held_by_two_processes_is_counted() -> None:
    """With a limit of 3, the key is full once (after seq 3) with holders of p0 and p1."""
    assert slot_proof(_rows(), K, 3).mixed_full == 1


def test_a_gap_in_the_seqs_fails() -> None:
    """An event missing from the middle of the log shows as a seq that skips."""
    rows = _rows()
    rows.log.pop(1)
    assert any("has seq 3" in p for p in _problems(rows))


def test_a_counter_or_slot_row_that_disagrees_fails() -> None:
    """A counter one too high, or a slot row too many, against the log's replay."""
    assert any("counter" in p for p in _problems(_rows(counters=[(K, "ann", 3, 5, 4)])))
    extra = _rows()
    extra.slots.append((K, "ann", "r3", 2))
    assert any("3 slot rows" in p for p in _problems(extra))


def test_an_instance_in_the_state_without_a_slot_fails() -> None:
    """r3 in review with no slot row (the slot leaked away, or was never taken)."""
    rows = _rows()
    rows.instances[2] = ("r3", "review", "in_review", 3, {"reviewer": "ann"})
    assert any("r3 is in the states" in p for p in _problems(rows))


def test_a_take_without_its_transition_fails() -> None:
    """A take whose version is no applied start, and a start with no take in the log."""
    rows = _rows()
    rows.history.append(("r1", 3, "start", "p0"))
    rows.history[0] = ("r1", 2, "finish", "p0")
    problems = _problems(rows)
    assert any("r1 v2 delta 1 is event 'finish'" in p for p in problems)
    assert any("r1 v3 (start) took no slot" in p for p in problems)


def test_a_rate_window_over_its_limit_fails() -> None:
    """Three pings within a second under a limit of 2 fail; spaced a second apart they pass
    (the window is half-open: a ping exactly `per` later is in the next one)."""
    history = [("t", v, "ping", "p0") for v in range(2, 6)]
    crowded = [("r", "sku", at, "t", v, 2, 1.0) for v, at in ((2, 0.0), (3, 0.5), (4, 0.9))]
    spaced = [("r", "sku", at, "t", v, 2, 1.0) for v, at in ((2, 0.0), (3, 0.5), (4, 1.0))]
    bad = rate_proof(_rows(rates=crowded, history=history), "r", 2, 1.0)
    good = rate_proof(_rows(rates=spaced, history=history), "r", 2, 1.0)
    assert len(bad.problems) == 1 and bad.busiest == {"sku": 3}
    assert good.problems == [] and good.busiest == {"sku": 2}
