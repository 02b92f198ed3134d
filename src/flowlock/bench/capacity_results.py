"""What the capacity scenarios measured beyond the usual figures, as plain values.

Two proofs and two figures, all pure (docs/benchmarks.md, "The capacity scenarios"):

- the most holders any key ever had, replayed from the slot log in (key, seq) order: each
  take adds one, each release takes one away. The log's order is the counter row's lock
  order, so the replay is what the database saw, not what a sampler caught;
- that every applied move of the history has its slot event, and no event lacks its move;
- refusals: the `CapacityReached` answers the callers retried after;
- Jain's fairness index over the applied entries of the callers that had to wait.

Nothing here does I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flowlock.checker.verdicts import OVER_CAPACITY, SLOT_LOG, Violation
from flowlock.core.models import HistoryEntry

__all__ = [
    "OVER_CAPACITY",
    "SLOT_LOG",
    "CapacityFigures",
    "HoldersProof",
    "LogRow",
    "jain",
    "match_history",
    "prove_holders",
]

# The violations (the checker's kinds): OVER_CAPACITY, a key had more holders than its limit
# at some point of its slot log; SLOT_LOG, the log contradicts itself or the history (a gap in
# a key's sequence, a count that does not add up, a move without its slot event or the reverse).


@dataclass(frozen=True, slots=True)
class LogRow:
    """One slot event as the checker needs it: +1 a take, -1 a release, and the holder count
    the writer recorded after it."""

    key: str
    seq: int
    instance_id: str
    delta: int
    holders: int


@dataclass(frozen=True, slots=True)
class HoldersProof:
    """The replay of a slot log: the most holders of any key, and what did not add up."""

    max_holders: int
    problems: tuple[Violation, ...] = ()


def prove_holders(rows: Iterable[LogRow], limit: int) -> HoldersProof:
    """Replay `rows` per key in sequence order; the peak, and every inconsistency.

    The count is replayed from the deltas, not read from the rows: a writer that recorded a
    wrong count cannot hide an excess. The recorded count must agree all the same, the
    sequence must run 1, 2, 3 ... without a gap, and no count may go below zero.
    """
    by_key: dict[str, list[LogRow]] = {}
    for row in rows:
        by_key.setdefault(row.key, []).append(row)
    peak = 0
    found: list[Violation] = []
    for key, events in sorted(by_key.items()):
        held = 0
        key_peak = 0
        for expected, row in enumerate(sorted(events, key=lambda r: r.seq), start=1):
            if row.seq != expected:
                found.append(
                    Violation(
                        SLOT_LOG,
                        f"key {key!r}: event {row.seq} where {expected} was due (a gap or "
                        "a repeat in the key's sequence)",
                    )
                )
                break
            held += row.delta
            key_peak = max(key_peak, held)
            if held < 0 or row.holders != held:
                found.append(
                    Violation(
                        SLOT_LOG,
                        f"key {key!r}, event {row.seq} ({row.instance_id!r}): {held} holder(s) "
                        f"replayed, {row.holders} recorded",
                    )
                )
                break
        if key_peak > limit:
            found.append(
                Violation(
                    OVER_CAPACITY,
                    f"key {key!r} had {key_peak} holders at once; its limit is {limit}",
                )
            )
        peak = max(peak, key_peak)
    return HoldersProof(peak, tuple(found))


def match_history(
    rows: Iterable[LogRow],
    histories: Mapping[str, Sequence[HistoryEntry]],
    state: str,
) -> list[Violation]:
    """Every move into `state` in the histories has its take, every move out its release,
    per instance, and the log has nothing else."""
    want: Counter[tuple[str, int]] = Counter()
    for iid, entries in histories.items():
        for e in entries:
            if e.to_state == state and e.from_state != state:
                want[(iid, 1)] += 1
            elif e.from_state == state and e.to_state != state:
                want[(iid, -1)] += 1
    got: Counter[tuple[str, int]] = Counter((r.instance_id, r.delta) for r in rows)
    found: list[Violation] = []
    for (iid, delta), n in sorted((want - got).items()):
        what = "take" if delta > 0 else "release"
        found.append(
            Violation(SLOT_LOG, f"instance {iid!r}: {n} move(s) in history without a slot {what}")
        )
    for (iid, delta), n in sorted((got - want).items()):
        what = "take" if delta > 0 else "release"
        found.append(
            Violation(SLOT_LOG, f"instance {iid!r}: {n} slot {what}(s) without a move in history")
        )
    return found


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when every share is equal, 1/n when
    one gets all. None for no values, 0 when every value is 0 (nobody got anything)."""
    if not values:
        return None
    squares = sum(v * v for v in values)
    if squares == 0:
        return 0.0
    return sum(values) ** 2 / (len(values) * squares)


@dataclass(frozen=True, slots=True)
class CapacityFigures:
    """One capacity pair's extra figures over its timed rounds.

    - `limit`, `keys`: the rule and how many keys the callers shared (per round);
    - `max_holders`: the most holders of any key, replayed from the slot log;
    - `refusals`: `CapacityReached` answers (each retried after a jittered sleep, or the
      caller's last one when it gave up); `gave_up`: enters refused past the bound;
    - `waiters`: callers refused at least once; `jain_fairness`: Jain's index over their
      applied entries (None without waiters);
    - `log_events`: slot events replayed (takes and releases).
    """

    limit: int
    keys: int
    max_holders: int
    refusals: int
    gave_up: int
    waiters: int
    jain_fairness: float | None
    log_events: int

    @property
    def ok(self) -> bool:
        """Never above the limit."""
        return self.max_holders <= self.limit

    def to_json(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "keys": self.keys,
            "max_holders": self.max_holders,
            "refusals": self.refusals,
            "gave_up": self.gave_up,
            "waiters": self.waiters,
            "jain_fairness": None if self.jain_fairness is None else round(self.jain_fairness, 4),
            "log_events": self.log_events,
        }
