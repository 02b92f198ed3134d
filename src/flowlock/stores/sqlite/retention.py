"""The SQLite store's retention (a mixin of [`SqliteStore`][flowlock.stores.sqlite.SqliteStore]):
the [`RetentionStore`][flowlock.stores.base.RetentionStore] port. The age bound is on this host's
wall clock, the clock every commit stamps `updated_at` with (SQLite has no server clock)."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from flowlock.core.retention import ArchivedInstance, CreateRecord, Hold, PurgeSelection
from flowlock.stores.base import BeforeCommit
from flowlock.stores.sqlite.constraints_sql import free_slots
from flowlock.stores.sqlite.part import StorePart
from flowlock.stores.sqlite.sql import (
    IDS_PER_SELECT,
    INSERT_HISTORY,
    INSTANCE_COLUMNS,
    READ_WIDTH,
    dump_json,
    histories_of,
    history_params,
    instance_of,
    load_json,
    now_text,
    parse_timestamp,
    read_columns,
    timestamp_text,
)
from flowlock.stores.sqlite.txn import Wake

__all__ = ["SqliteRetention"]

_NOT_HELD: Final = "NOT EXISTS (SELECT 1 FROM flowlock_holds h WHERE h.instance_id = i.id)"
_HELD: Final = "EXISTS (SELECT 1 FROM flowlock_holds h WHERE h.instance_id = i.id)"
# An instance with a message still to deliver is kept: purging it would lose the delivery.
_NOTHING_PENDING: Final = (
    "NOT EXISTS (SELECT 1 FROM flowlock_outbox o WHERE o.instance_id = i.id "
    "AND o.status = 'pending')"
)
# The tables keyed by instance id, children first (the history and create records reference
# the instance; timers cascade, but are named so a build without foreign keys forgets none).
_CHILDREN: Final = (
    "DELETE FROM flowlock_history WHERE instance_id = ?",
    "DELETE FROM flowlock_create_requests WHERE instance_id = ?",
    "DELETE FROM flowlock_timers WHERE instance_id = ?",
    "DELETE FROM flowlock_outbox WHERE instance_id = ?",
)


def _hold_of(row: Sequence[Any]) -> Hold:
    return Hold(row[0], row[1], row[2], parse_timestamp(row[3]))


def _selected(selection: PurgeSelection) -> tuple[str, list[Any]]:
    """The clause of the instances `selection` takes now, holds aside, and its arguments."""
    bound = datetime.now(UTC) - timedelta(seconds=selection.older_than)
    clauses = ["i.workflow = ?", "i.updated_at < ?", _NOTHING_PENDING]
    args: list[Any] = [selection.workflow, timestamp_text(bound)]
    if selection.states is not None:
        clauses.append(f"i.state IN ({', '.join('?' * len(selection.states))})")
        args.extend(selection.states)
    return " AND ".join(clauses), args


def hold_txn(conn: sqlite3.Connection, hold: Hold) -> Hold:
    conn.execute(
        "INSERT INTO flowlock_holds (instance_id, reason, actor, at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (instance_id) DO NOTHING",
        (hold.instance_id, hold.reason, hold.actor, now_text()),
    )
    row = conn.execute(
        "SELECT instance_id, reason, actor, at FROM flowlock_holds WHERE instance_id = ?",
        (hold.instance_id,),
    ).fetchone()
    # Under the write lock a purge holds too: the instance is there or gone for both.
    found = conn.execute(
        "SELECT 1 FROM flowlock_instances WHERE id = ?", (hold.instance_id,)
    ).fetchone()
    return dataclasses.replace(_hold_of(row), instance_found=found is not None)


def unhold_txn(conn: sqlite3.Connection, instance_id: str) -> bool:
    cur = conn.execute("DELETE FROM flowlock_holds WHERE instance_id = ?", (instance_id,))
    return cur.rowcount > 0


def holds_txn(conn: sqlite3.Connection, after: str | None, limit: int) -> list[Hold]:
    rows = conn.execute(
        "SELECT instance_id, reason, actor, at FROM flowlock_holds WHERE instance_id > ? "
        "ORDER BY instance_id LIMIT ?",
        (after or "", limit),
    ).fetchall()
    return [_hold_of(row) for row in rows]


def count_txn(conn: sqlite3.Connection, selection: PurgeSelection) -> tuple[int, int]:
    where, args = _selected(selection)
    total, held = conn.execute(
        f"SELECT count(*), coalesce(sum({_HELD}), 0) FROM flowlock_instances i WHERE {where}",
        args,
    ).fetchone()
    return int(total) - int(held), int(held)


def candidates_txn(
    conn: sqlite3.Connection, selection: PurgeSelection, after: str | None, limit: int
) -> list[ArchivedInstance]:
    where, args = _selected(selection)
    rows = conn.execute(
        f"SELECT {read_columns('i')}, i.fencing_token FROM flowlock_instances i "
        f"WHERE {where} AND {_NOT_HELD} AND i.id > ? ORDER BY i.id LIMIT ?",
        [*args, after or "", limit],
    ).fetchall()
    found = [(instance_of(row), row[READ_WIDTH]) for row in rows]
    ids = [inst.id for inst, _ in found]
    histories = histories_of(conn, ids)
    created: dict[str, CreateRecord] = {}
    for at in range(0, len(ids), IDS_PER_SELECT):
        chunk = ids[at : at + IDS_PER_SELECT]
        marks = ", ".join("?" * len(chunk))
        for row in conn.execute(
            "SELECT request_id, instance_id, state, data FROM flowlock_create_requests "
            f"WHERE instance_id IN ({marks})",
            chunk,
        ):
            created[row[1]] = CreateRecord(row[0], row[2], load_json(row[3], f"create {row[0]!r}"))
    # Separate statements, separate snapshots: rows of a later version belong to a move that
    # makes the delete's compare-and-swap keep the instance anyway.
    return [
        ArchivedInstance(
            inst,
            tuple(e for e in histories[inst.id] if e.version <= inst.version),
            token,
            created.get(inst.id),
        )
        for inst, token in found
    ]


def purge_txn(
    conn: sqlite3.Connection,
    victims: Sequence[tuple[str, int]],
    before_commit: BeforeCommit | None,
    wake: Wake,
) -> list[str]:
    """Inside the store's write transaction (SQLite's write lock: nothing moves meanwhile)."""
    doomed = sorted(
        iid
        for iid, version in dict(victims).items()
        if conn.execute(
            f"SELECT 1 FROM flowlock_instances i WHERE i.id = ? AND i.version = ? "
            f"AND {_NOT_HELD} AND {_NOTHING_PENDING}",
            (iid, version),
        ).fetchone()
    )
    for iid in doomed:
        # A purge takes final instances, which hold no slot; one that does frees it.
        free_slots(conn, iid, dict(victims)[iid], wake.released)
    keys = [(iid,) for iid in doomed]
    for statement in (*_CHILDREN, "DELETE FROM flowlock_instances WHERE id = ?"):
        conn.executemany(statement, keys)
    if before_commit is not None:
        before_commit(doomed)  # raises: the store rolls the transaction back
    return doomed


def restore_txn(conn: sqlite3.Connection, archived: Sequence[ArchivedInstance]) -> list[str]:
    restored: list[str] = []
    for item in archived:
        inst = item.instance
        cur = conn.execute(
            f"INSERT INTO flowlock_instances ({INSTANCE_COLUMNS}, paused, fencing_token, "
            "definition_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO NOTHING",
            (
                inst.id,
                inst.workflow,
                inst.state,
                inst.version,
                dump_json(inst.data, f"data of archived instance {inst.id!r}"),
                inst.last_event,
                _text(inst.created_at),
                _text(inst.updated_at),
                inst.stay_version,
                int(inst.paused),
                item.fencing_token,
                inst.definition_version,
            ),
        )
        if cur.rowcount == 0:
            continue  # the id exists: skipped, its history with it
        conn.executemany(
            INSERT_HISTORY,
            [
                history_params(
                    e,
                    dump_json(e.data, f"data of {inst.id!r} v{e.version}"),
                    dump_json(e.payload, f"payload of {inst.id!r} v{e.version}"),
                    _text(e.at),
                )
                for e in item.history
            ],
        )
        made = item.created
        if made is not None:
            conn.execute(
                "INSERT INTO flowlock_create_requests (request_id, instance_id, state, data) "
                "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (made.request_id, inst.id, made.state, dump_json(made.data, "create data")),
            )
        restored.append(inst.id)
    return restored


def _text(moment: datetime | None) -> str:
    return now_text() if moment is None else timestamp_text(moment)


class SqliteRetention(StorePart):
    """SqliteStore's part as a RetentionStore. Each write is one transaction under SQLite's
    write lock, which every writer of the file shares: a purge batch holds up all of them for
    its length (keep `batch` modest on a busy file)."""

    async def place_hold(self, hold: Hold) -> Hold:
        return await self._write_now(hold.instance_id, lambda conn, _: hold_txn(conn, hold), "hold")

    async def lift_hold(self, instance_id: str) -> bool:
        return await self._write_now(
            instance_id, lambda conn, _: unhold_txn(conn, instance_id), "unhold"
        )

    async def find_holds(self, *, after: str | None, limit: int) -> list[Hold]:
        return await self._read(holds_txn, after, limit, what="holds")

    async def purge_candidates(
        self, selection: PurgeSelection, *, after: str | None, limit: int
    ) -> list[ArchivedInstance]:
        return await self._read(candidates_txn, selection, after, limit, what="purge")

    async def count_purgeable(self, selection: PurgeSelection) -> tuple[int, int]:
        return await self._read(count_txn, selection, what="purge count")

    async def purge_batch(
        self, victims: Sequence[tuple[str, int]], before_commit: BeforeCommit | None = None
    ) -> list[str]:
        return await self._write_now(
            self.path, lambda conn, wake: purge_txn(conn, victims, before_commit, wake), "purge"
        )

    async def restore_instances(self, archived: Sequence[ArchivedInstance]) -> list[str]:
        return await self._write_now(
            self.path, lambda conn, _: restore_txn(conn, archived), "restore"
        )
