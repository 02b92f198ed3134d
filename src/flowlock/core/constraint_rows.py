"""The rows a store keeps for its constraints, as plain values: what `ConstraintStore`
answers and what the checker proves the limits from (both read them from here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConstraintRows", "CounterRow", "RateEvent", "SlotEvent", "SlotRow"]


@dataclass(frozen=True, slots=True)
class SlotEvent:
    """One take (`delta` +1) or release (-1) of a key's slot, by the commit that moved
    `instance_id` to `version`; `seq` counts the key's events from 1, `holders` is the count
    after it, `limit` the rule's limit at the time, `at` the server's clock (epoch seconds)."""

    kind: str
    key: str
    seq: int
    instance_id: str
    version: int
    delta: int
    holders: int
    limit: int
    at: float


@dataclass(frozen=True, slots=True)
class SlotRow:
    """A slot held now: `instance_id` holds one of `key` since the commit of `version`."""

    kind: str
    key: str
    instance_id: str
    version: int


@dataclass(frozen=True, slots=True)
class CounterRow:
    """A key's counter: holders now, the last limit used, the last event's `seq`."""

    kind: str
    key: str
    holders: int
    limit: int
    seq: int


@dataclass(frozen=True, slots=True)
class RateEvent:
    """One application counted against a rate limit, timed `at` (epoch seconds)."""

    kind: str
    key: str
    instance_id: str
    version: int
    at: float
    limit: int
    per: float


@dataclass(frozen=True, slots=True)
class ConstraintRows:
    """Everything the checker reads about constraints, in one consistent read where the store
    can: events in (kind, key, seq) order, rate events in (kind, key, at) order."""

    log: tuple[SlotEvent, ...]
    slots: tuple[SlotRow, ...]
    counters: tuple[CounterRow, ...]
    rates: tuple[RateEvent, ...]
