"""What the memory and SQLite stores share when they apply a commit's constraint claims: the
claims of a batch in order, and the typed refusals (see
[`flowlock.stores.constraint_store`][flowlock.stores.constraint_store] for the semantics)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from flowlock.core.constraints import (
    CapacityReached,
    Claim,
    ConstraintRefused,
    RateLimited,
    UniqueViolation,
)
from flowlock.core.models import HistoryEntry

__all__ = ["Claimed", "claims_of", "rate_refusal", "take_refusal"]


@dataclass(frozen=True, slots=True)
class Claimed:
    """One claim with the commit it belongs to: the instance, the version the commit moves it
    to (1 for a create) and its event (None for a create)."""

    claim: Claim
    instance_id: str
    version: int
    event: str | None


def claims_of(entries: Sequence[HistoryEntry]) -> Iterator[Claimed]:
    """Every claim of a batch's entries, entry by entry, in the order the step gave them."""
    for entry in entries:
        for claim in entry.claims:
            yield Claimed(claim, entry.instance_id, entry.version, entry.event)


def take_refusal(c: Claimed, holders: Sequence[str]) -> ConstraintRefused:
    """The error of a take refused because `holders` (oldest first) fill the key."""
    claim = c.claim
    if claim.unique:
        return UniqueViolation(
            instance_id=c.instance_id,
            kind=claim.kind,
            key=claim.key,
            holder=holders[0] if holders else None,
            version=c.version,
            event=c.event,
        )
    return CapacityReached(
        instance_id=c.instance_id,
        kind=claim.kind,
        key=claim.key,
        limit=claim.limit,
        holders=holders,
        version=c.version,
        event=c.event,
    )


def rate_refusal(c: Claimed, counted: int, oldest: float | None, now: float) -> RateLimited | None:
    """The error of a count when `counted` applications of the key fall within the last `per`
    seconds and that reaches the limit, else None. `oldest`: the time of the oldest of the
    last `limit` of them; once it leaves the window, one more fits (`retry_after`)."""
    claim = c.claim
    if counted < claim.limit or oldest is None:
        return None
    return RateLimited(
        instance_id=c.instance_id,
        kind=claim.kind,
        key=claim.key,
        limit=claim.limit,
        per=claim.per,
        retry_after=oldest + claim.per - now,
        version=c.version,
        event=c.event,
    )
