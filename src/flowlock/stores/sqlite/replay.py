"""The SQLite store's replay reads (a mixin of [`SqliteStore`][flowlock.stores.sqlite.SqliteStore]):
the [`ReplayStore`][flowlock.stores.replaying.ReplayStore] port, a batch of instances and their
histories in one read transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from flowlock.core.models import HistoryEntry
from flowlock.stores.replaying import ReplayRow, replay_row
from flowlock.stores.sqlite.part import StorePart
from flowlock.stores.sqlite.sql import (
    HISTORY_COLUMNS,
    IDS_PER_SELECT,
    READ_WIDTH,
    entry_of,
    instance_of,
    load_json,
    read_columns,
)
from flowlock.stores.sqlite.txn import _deferred

__all__ = ["SqliteReplay"]

_SELECT = f"SELECT {read_columns('i')}, i.initial_data FROM flowlock_instances i"


def _rows(conn: sqlite3.Connection, found: list[Any]) -> list[ReplayRow]:
    """Each instance row of `found` with its creation data and history."""
    ids = [row[0] for row in found]
    histories: dict[str, list[HistoryEntry]] = {i: [] for i in ids}
    for at in range(0, len(ids), IDS_PER_SELECT):
        chunk = ids[at : at + IDS_PER_SELECT]
        marks = ", ".join("?" * len(chunk))
        for row in conn.execute(
            f"SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id IN ({marks}) "
            "ORDER BY instance_id, version",
            chunk,
        ):
            histories[row[0]].append(entry_of(row))
    out: list[ReplayRow] = []
    for row in found:
        raw = row[READ_WIDTH]
        initial = None if raw is None else load_json(raw, f"initial data of {row[0]!r}")
        made = replay_row(instance_of(row), initial, histories[row[0]])
        if made is not None:
            out.append(made)
    return out


def batch_txn(
    conn: sqlite3.Connection, workflow: str, after: str | None, limit: int
) -> list[ReplayRow]:
    def read(conn: sqlite3.Connection) -> list[ReplayRow]:
        found = conn.execute(
            f"{_SELECT} WHERE i.workflow = ? AND i.id > ? ORDER BY i.id LIMIT ?",
            (workflow, after or "", limit),
        ).fetchall()
        return _rows(conn, found)

    return _deferred(conn, read)  # one snapshot: the instances and their histories


def ids_txn(conn: sqlite3.Connection, instance_ids: Sequence[str]) -> list[ReplayRow]:
    def read(conn: sqlite3.Connection) -> list[ReplayRow]:
        found: list[Any] = []
        ids = sorted(set(instance_ids))
        for at in range(0, len(ids), IDS_PER_SELECT):
            chunk = ids[at : at + IDS_PER_SELECT]
            marks = ", ".join("?" * len(chunk))
            found += conn.execute(f"{_SELECT} WHERE i.id IN ({marks})", chunk).fetchall()
        found.sort(key=lambda row: row[0])
        return _rows(conn, found)

    return _deferred(conn, read)  # one snapshot: the instances and their histories


class SqliteReplay(StorePart):
    """SqliteStore's part as a ReplayStore."""

    async def replay_batch(self, workflow: str, after: str | None, limit: int) -> list[ReplayRow]:
        return await self._read(batch_txn, workflow, after, limit, what="replay_batch")

    async def replay_instances(self, instance_ids: Sequence[str]) -> list[ReplayRow]:
        return await self._read(ids_txn, list(instance_ids), what="replay_instances")
