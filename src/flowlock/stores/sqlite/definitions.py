"""The SQLite store's definition versions (a mixin of
[`SqliteStore`][flowlock.stores.sqlite.SqliteStore]): the
[`DefinitionStore`][flowlock.stores.base.DefinitionStore] port. A save is one write transaction,
which holds the database's write lock, so the lookup and the insert see no other writer."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from flowlock.core.versions import DefinitionVersion
from flowlock.stores.sqlite.part import StorePart
from flowlock.stores.sqlite.sql import dump_json, load_json, now_text, parse_timestamp
from flowlock.stores.sqlite.txn import Wake

__all__ = ["SqliteDefinitions"]

_COLUMNS = "workflow, version, hash, definition, created_at"
# Each version with how many instances are pinned to it (one pass over the instances).
_LISTED = f"""
SELECT {", ".join(f"d.{c}" for c in _COLUMNS.split(", "))}, coalesce(n.count, 0)
  FROM flowlock_definitions d
  LEFT JOIN (SELECT workflow, definition_version, count(*) AS count FROM flowlock_instances
              WHERE definition_version IS NOT NULL GROUP BY workflow, definition_version) n
    ON n.workflow = d.workflow AND n.definition_version = d.version
"""


def _version_of(row: tuple[Any, ...], *, new: bool = False) -> DefinitionVersion:
    return DefinitionVersion(
        workflow=row[0],
        version=row[1],
        hash=row[2],
        created_at=parse_timestamp(row[4]),
        definition=load_json(row[3], f"definition {row[0]!r} v{row[1]}"),
        new=new,
        instances=row[5] if len(row) > 5 else None,
    )


def save_txn(
    conn: sqlite3.Connection, workflow: str, hash: str, text: str, _: Wake
) -> DefinitionVersion:
    found = conn.execute(
        f"SELECT {_COLUMNS} FROM flowlock_definitions WHERE workflow = ? AND hash = ?",
        (workflow, hash),
    ).fetchone()
    if found is not None:
        return _version_of(found)
    (top,) = conn.execute(
        "SELECT coalesce(max(version), 0) FROM flowlock_definitions WHERE workflow = ?",
        (workflow,),
    ).fetchone()
    row = (workflow, int(top) + 1, hash, text, now_text())
    conn.execute(f"INSERT INTO flowlock_definitions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?)", row)
    return _version_of(row, new=True)


def list_txn(conn: sqlite3.Connection, workflow: str | None) -> list[DefinitionVersion]:
    where, args = ("WHERE d.workflow = ? ", (workflow,)) if workflow is not None else ("", ())
    rows = conn.execute(f"{_LISTED}{where}ORDER BY d.workflow, d.version", args).fetchall()
    return [_version_of(row) for row in rows]


def one_txn(conn: sqlite3.Connection, workflow: str, version: int) -> DefinitionVersion | None:
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM flowlock_definitions WHERE workflow = ? AND version = ?",
        (workflow, version),
    ).fetchone()
    return None if row is None else _version_of(row)


class SqliteDefinitions(StorePart):
    """SqliteStore's part as a DefinitionStore."""

    async def save_definition(
        self, workflow: str, hash: str, definition: Mapping[str, Any]
    ) -> DefinitionVersion:
        """The version of `workflow` with `hash`: the stored one, or the next number (`new`)."""
        text = dump_json(definition, f"the definition of workflow {workflow!r}")
        return await self._write_now(
            workflow,
            lambda conn, wake: save_txn(conn, workflow, hash, text, wake),
            "save_definition",
        )

    async def definitions(self, workflow: str | None = None) -> list[DefinitionVersion]:
        """Every stored version (of `workflow`), each with its count of pinned instances."""
        return await self._read(list_txn, workflow, what="definitions")

    async def definition(self, workflow: str, version: int) -> DefinitionVersion | None:
        """The stored version `version` of `workflow`, or None."""
        return await self._read(one_txn, workflow, version, what="definition")
