"""The PostgreSQL store's definition versions: the
[`DefinitionStore`][flowlock.stores.base.DefinitionStore] methods over `flowlock_definitions`
(015_definitions.sql).

A save is one statement that finds the hash or inserts the next number. Two processes saving at
once meet on the table's unique keys: the loser's insert does nothing (ON CONFLICT, after the
winner commits) and it runs the statement again, on a fresh snapshot that sees the winner's row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import asyncpg

from flowlock._pg.rows import json_object
from flowlock.core.errors import StoreError
from flowlock.core.versions import DefinitionVersion
from flowlock.stores.postgres.calls import Calls
from flowlock.stores.postgres.operations import Operations

__all__ = ["DefinitionMethods"]

_COLUMNS = "workflow, version, hash, definition, created_at"
# $1 workflow, $2 hash, $3 the canonical form (JSON text). No row back: another save won a key
# after this statement's snapshot was taken; run it again.
_SAVE = f"""
WITH found AS (
    SELECT {_COLUMNS}, false AS new FROM flowlock_definitions WHERE workflow = $1 AND hash = $2
), made AS (
    INSERT INTO flowlock_definitions (workflow, version, hash, definition)
    SELECT $1, coalesce((SELECT max(version) FROM flowlock_definitions WHERE workflow = $1), 0) + 1,
           $2, $3::text::jsonb
     WHERE NOT EXISTS (SELECT FROM found)
    ON CONFLICT DO NOTHING
    RETURNING {_COLUMNS}, true AS new
)
SELECT * FROM found UNION ALL SELECT * FROM made
"""
# Each version with how many instances are pinned to it ($1 the workflow, NULL: every one).
_LIST = f"""
SELECT {", ".join(f"d.{c}" for c in _COLUMNS.split(", "))}, coalesce(n.count, 0) AS instances
  FROM flowlock_definitions d
  LEFT JOIN (SELECT workflow, definition_version, count(*) AS count FROM flowlock_instances
              WHERE definition_version IS NOT NULL AND ($1::text IS NULL OR workflow = $1)
              GROUP BY workflow, definition_version) n
    ON n.workflow = d.workflow AND n.definition_version = d.version
 WHERE $1::text IS NULL OR d.workflow = $1
 ORDER BY d.workflow COLLATE "C", d.version
"""
_ONE = f"SELECT {_COLUMNS} FROM flowlock_definitions WHERE workflow = $1 AND version = $2"
# $1 workflow, $2 hash: a plain read first, so registering a stored definition writes nothing
# (a read-only session, as the inspection commands open, can register what is stored).
_FIND = f"SELECT {_COLUMNS} FROM flowlock_definitions WHERE workflow = $1 AND hash = $2"
# Enough for every process of a fleet registering a new definition at the same moment.
_ATTEMPTS = 50


def _version_of(row: asyncpg.Record) -> DefinitionVersion:
    return DefinitionVersion(
        workflow=row["workflow"],
        version=row["version"],
        hash=row["hash"],
        created_at=row["created_at"],
        definition=json_object(row["definition"]),
        new=bool(row.get("new")),
        instances=row.get("instances"),
    )


async def _save(ops: Operations, workflow: str, hash: str, text: str) -> DefinitionVersion:
    s = ops.session
    async with s.conn(workflow, writes=True) as conn:
        found = await conn.fetchrow(s.sql(_FIND), workflow, hash, timeout=s.timeout)
        if found is not None:
            return _version_of(found)
        for _ in range(_ATTEMPTS):
            row = await conn.fetchrow(s.sql(_SAVE), workflow, hash, text, timeout=s.timeout)
            if row is not None:
                return _version_of(row)
    raise StoreError(
        f"saving a definition of workflow {workflow!r} lost to other saves {_ATTEMPTS} times; "
        "nothing was written by this call. Register it again"
    )


async def _list(ops: Operations, workflow: str | None) -> list[DefinitionVersion]:
    s = ops.session
    async with s.conn() as conn:
        rows = await conn.fetch(s.sql(_LIST), workflow, timeout=s.timeout)
    return [_version_of(row) for row in rows]


async def _one(ops: Operations, workflow: str, version: int) -> DefinitionVersion | None:
    s = ops.session
    async with s.conn() as conn:
        row = await conn.fetchrow(s.sql(_ONE), workflow, version, timeout=s.timeout)
    return None if row is None else _version_of(row)


class DefinitionMethods:
    """PostgresStore's part as a DefinitionStore (a mixin: the store is `self`)."""

    async def save_definition(
        self: Calls, workflow: str, hash: str, definition: Mapping[str, Any]
    ) -> DefinitionVersion:
        text = json.dumps(definition, separators=(",", ":"), ensure_ascii=False)
        return await self._call(lambda ops: _save(ops, workflow, hash, text), workflow, writes=True)

    async def definitions(self: Calls, workflow: str | None = None) -> list[DefinitionVersion]:
        return await self._call(lambda ops: _list(ops, workflow), waits=False)

    async def definition(self: Calls, workflow: str, version: int) -> DefinitionVersion | None:
        return await self._call(lambda ops: _one(ops, workflow, version), waits=False)
