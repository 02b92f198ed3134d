"""The constraints' SQL: what a commit's claims do, in the statement of its compare-and-swap.

A commit whose entries carry claims (capacities, uniqueness, rate limits) runs a variant of
its statement with one more CTE, `claimed`, which calls `flowlock_claims` (017_constraints.sql)
with the instances written and the claims as arrays. The final SELECT reads `claimed`, so it
runs (a plain SELECT CTE that nothing reads is never run), and it reads the history rows the
statement inserted, so the history's own checks (a request id applied before) come first. A
claim that does not fit raises SQLSTATE FL028: the whole statement rolls back, and the error
edge (`flowlock._pg.errors`) makes it the claim's ConstraintRefused. Statements of commits
without claims are the texts they always were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flowlock._pg.rows import INSTANCE_COLUMNS
from flowlock.core.constraints import Claim
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.postgres.outbox_sql import OUTBOX_ARRAYS, outbox_cte
from flowlock.stores.postgres.timer_sql import TIMER_ARRAYS, armed_create, timer_ctes

__all__ = [
    "CLAIM_ARRAYS",
    "claim_args",
    "claimed_creates",
    "claimed_variants",
    "create_claim_args",
]

CLAIM_ARRAYS = 9
"""How many parameters `claims_cte` reads (one array each)."""


def claims_cte(k: int, source: str, column: str) -> str:
    """The CTE that applies the claims (the arrays of `claim_args`, parameters $k to $k+8)
    of the instances `column` of CTE `source` names: those written by this statement."""
    return f"""
, claimed AS (
    SELECT flowlock_claims(
        ARRAY(SELECT DISTINCT {column} FROM {source}), ${k}::text[], ${k + 1}::bigint[],
        ${k + 2}::text[], ${k + 3}::text[], ${k + 4}::text[], ${k + 5}::text[], ${k + 6}::int[],
        ${k + 7}::float8[], ${k + 8}::boolean[]) AS flowlock_applied
)"""


_CLAIMED_MOVED = "\nSELECT moved.* FROM moved CROSS JOIN claimed\n"
_CLAIMED_MADE = "\nSELECT made.* FROM made CROSS JOIN claimed\n"


def _returning(text: str, column: str) -> str:
    """`text`, whose last CTE is an INSERT, with that INSERT returning `column`."""
    body = text.rstrip()
    assert body.endswith(")"), body[-40:]
    return f"{body[:-1].rstrip()}\n RETURNING {column}\n)"


def claimed_variants(base: str, k: int) -> tuple[str, str, str, str]:
    """The four variants of a compare-and-swap `base` (moved, then logged: the history's
    INSERT) that apply claims: alone, after the timers' CTEs, after the messages', after both.
    The timers' arrays start at $k, the messages' after them, the claims' after those."""
    logged = _returning(base, "instance_id")
    claims = claims_cte
    return (
        logged + claims(k, "logged", "instance_id") + _CLAIMED_MOVED,
        logged + timer_ctes(k) + claims(k + TIMER_ARRAYS, "logged", "instance_id")
        + _CLAIMED_MOVED,
        logged + outbox_cte(k) + claims(k + OUTBOX_ARRAYS, "logged", "instance_id")
        + _CLAIMED_MOVED,
        logged + timer_ctes(k) + outbox_cte(k + TIMER_ARRAYS)
        + claims(k + TIMER_ARRAYS + OUTBOX_ARRAYS, "logged", "instance_id") + _CLAIMED_MOVED,
    )  # fmt: skip


def claimed_creates(create: str, keyed: str) -> tuple[str, str, str, str]:
    """A create (`create`: the instance's INSERT, $1 to $5) that applies its claims: plain,
    arming the initial state's timers, under an idempotency key ($6; `keyed`: the key's CTE,
    reading `made`), both. The key's INSERT runs before the claims (they read what it
    inserted): a key recorded before fails the statement before any claim is applied, and the
    create is answered from its key."""
    made = f"\nWITH made AS (\n{create.strip()}\n)"
    keyed_returning = _returning(keyed, "instance_id")

    def unselected(text: str) -> str:
        head, _, tail = text.rstrip().rpartition("\nSELECT ")
        assert tail == f"{INSTANCE_COLUMNS} FROM made", tail
        return head

    timed = unselected(armed_create(create, 6))
    timed_keyed = unselected(armed_create(create, 7, keyed_returning))
    return (
        made + claims_cte(6, "made", "id") + _CLAIMED_MADE,
        timed + claims_cte(10, "made", "id") + _CLAIMED_MADE,
        made + keyed_returning + claims_cte(7, "keyed", "instance_id") + _CLAIMED_MADE,
        timed_keyed + claims_cte(11, "keyed", "instance_id") + _CLAIMED_MADE,
    )


def _columns(rows: Sequence[tuple[Any, ...]]) -> tuple[list[Any], ...]:
    columns: tuple[list[Any], ...] = tuple([] for _ in range(CLAIM_ARRAYS))
    for row in rows:
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return columns


def _row(iid: str, version: int, event: str | None, claim: Claim) -> tuple[Any, ...]:
    return (
        iid,
        version,
        event,
        claim.op,
        claim.kind,
        claim.key,
        claim.limit,
        claim.per,
        claim.unique,
    )


def claim_args(batches: Sequence[Sequence[HistoryEntry]]) -> tuple[list[Any], ...] | None:
    """The parameters of `claims_cte` for one batch per instance (every claim of every entry,
    in order), or None when no entry carries a claim (the statement without it is used)."""
    if not any(entry.claims for batch in batches for entry in batch):
        return None  # the hot path: nothing to build
    return _columns(
        [
            _row(entry.instance_id, entry.version, entry.event, claim)
            for batch in batches
            for entry in batch
            for claim in entry.claims
        ]
    )


def create_claim_args(instance: Instance, claims: Sequence[Claim]) -> tuple[list[Any], ...]:
    """The parameters of `claims_cte` for a create's claims (version 1, no event)."""
    return _columns([_row(instance.id, 1, None, claim) for claim in claims])
