"""The PostgreSQL store's replay reads (a mixin of PostgresStore): the
[`ReplayStore`][flowlock.stores.replaying.ReplayStore] port.
A batch is two statements: a keyset page
of the workflow's instances (the id index, in code point order), then their histories by the
history's primary key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from flowlock._pg.rows import HISTORY_COLUMNS, INSTANCE_COLUMNS, entry_from_row, instance_from_row
from flowlock._pg.rows import json_object as _json
from flowlock.core.models import HistoryEntry
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.operations import Operations
from flowlock.stores.replaying import ReplayRow, replay_row

__all__ = ["ReplayMethods"]

# $1 workflow, $2 the id to start after ('' from the first), $3 the limit.
_PAGE: Final = f"""
SELECT {INSTANCE_COLUMNS}, initial_data FROM flowlock_instances
 WHERE workflow = $1 AND id COLLATE "C" > $2 ORDER BY id COLLATE "C" LIMIT $3
"""
_BY_ID: Final = f"""
SELECT {INSTANCE_COLUMNS}, initial_data FROM flowlock_instances
 WHERE id = ANY($1::text[]) ORDER BY id COLLATE "C"
"""
_HISTORIES: Final = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history
 WHERE instance_id = ANY($1::text[]) ORDER BY instance_id, version
"""


async def _read(ops: Operations, sql: str, *args: Any) -> list[ReplayRow]:
    """The instances `sql` selects, then their histories. Two statements, two snapshots: a row
    above an instance's version read belongs to a later move and is left out (`replay_row`)."""
    s = ops.session
    async with s.conn() as conn:
        found = await conn.fetch(s.sql(sql), *args, timeout=s.timeout)
        ids = [row["id"] for row in found]
        histories: dict[str, list[HistoryEntry]] = {i: [] for i in ids}
        if ids:
            for h in await conn.fetch(s.sql(_HISTORIES), ids, timeout=s.timeout):
                histories[h["instance_id"]].append(entry_from_row(h))
    out: list[ReplayRow] = []
    for row in found:
        raw = row["initial_data"]
        made = replay_row(
            instance_from_row(row), None if raw is None else _json(raw), histories[row["id"]]
        )
        if made is not None:
            out.append(made)
    return out


class ReplayMethods:
    """PostgresStore's part as a ReplayStore (a mixin: the store is `self`)."""

    async def replay_batch(
        self: Calls, workflow: str, after: str | None, limit: int
    ) -> list[ReplayRow]:
        return await self._call(
            lambda ops: _read(ops, _PAGE, workflow, after or "", limit), waits=False
        )

    async def replay_instances(self: Calls, instance_ids: Sequence[str]) -> list[ReplayRow]:
        ids = sorted(set(instance_ids))
        return await self._call(lambda ops: _read(ops, _BY_ID, ids), waits=False)
