"""What the PostgreSQL store's batch and pipeline tests share: a chain of history entries the
checker can follow, instances to apply them to, and the exactly-once check over what was written.

Instances start in state ``s1`` at version 1 with data ``{"n": 1}``; :func:`step` moves one from
``s<v-1>`` to ``s<v>`` with data ``{"n": v}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from flowlock.checker import check
from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.postgres import PostgresStore

SqlHistory = Callable[..., Awaitable[Any]]


def step(
    iid: str,
    version: int,
    request_id: str | None = None,
    *,
    token: int | None = None,
    strategy: str = "optimistic",
) -> HistoryEntry:
    """The entry that moves ``iid`` to ``version``: from state s<v-1> to s<v>, data {"n": v}, so
    the checker can follow the chain."""
    return HistoryEntry(
        instance_id=iid,
        version=version,
        event=f"e{version}",
        from_state=f"s{version - 1}",
        to_state=f"s{version}",
        actor="tester",
        request_id=request_id,
        strategy=strategy,
        data={"n": version},
        fencing_token=token,
        payload={"call": request_id},
    )


async def created(store: PostgresStore, *ids: str) -> None:
    for iid in ids:
        await store.create(Instance(iid, "wf", "s1", 1, {"n": 1}))


async def assert_exactly_once(
    store: PostgresStore, sql_history: SqlHistory, applied: dict[str, int]
) -> None:
    """Each instance's history passes the checker with ``applied[iid]`` transitions, and the
    table (counted with plain SQL) agrees row for row."""
    histories = {iid: await store.history(iid) for iid in applied}
    for iid, rows in histories.items():
        verdict = check(
            await store.get(iid), rows, initial_state="s1", expected_applied=applied[iid]
        )
        assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches(histories)
