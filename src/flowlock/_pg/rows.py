"""Rows of flowlock's tables as models, and the bulk reads of whole sets of instances.

The column lists are the ones the mappers read; statements that feed a mapper select them. The
`data` columns are read whether the connection decodes `jsonb` (the pools of
`flowlock._pg.pool.create_pool` do) or hands it over as text (an application's own pool or
connection, which flowlock must not change): both always hold a JSON object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from flowlock.core.models import HistoryEntry, Instance, Timer
from flowlock.core.outbox import Message

__all__ = [
    "HISTORIES_BY_IDS",
    "HISTORY_COLUMNS",
    "INSTANCE_COLUMNS",
    "MESSAGE_COLUMNS",
    "PAUSED_FROM",
    "TIMER_COLUMNS",
    "entry_from_row",
    "instance_from_row",
    "json_object",
    "message_columns",
    "message_from_row",
    "read_history",
    "read_instances",
    "timer_columns",
    "timer_from_row",
    "workflow_paused",
]

INSTANCE_COLUMNS = (
    "id, workflow, state, version, data, last_event, created_at, updated_at, stay_version, paused, "
    "definition_version"
)


def workflow_paused(table: str = "flowlock_instances") -> str:
    """Whether the workflow of the instance row `table` (its name or alias) is paused, as a
    select-list column `workflow_paused`: one probe of the pauses table's primary key."""
    return (
        "EXISTS (SELECT 1 FROM flowlock_workflow_pauses wp "
        f"WHERE wp.workflow = {table}.workflow) AS workflow_paused"
    )


PAUSED_FROM = workflow_paused()
"""The `workflow_paused` column of a statement reading flowlock_instances unaliased."""
HISTORY_COLUMNS = (
    "instance_id, version, event, from_state, to_state, actor, request_id, strategy, data, at, "
    "fencing_token, payload, definition_version"
)
# A timer as flowlock_timers holds it, with what only the server's clock tells: `lag`, seconds
# past due (0 before), and the claim only while it runs. timer_from_row reads these columns.
_TIMER_FIELDS = {
    "instance_id": "instance_id",
    "workflow": "workflow",
    "event": "event",
    "stay": "stay",
    "due_at": "due_at",
    "n": "n",
    "every": "every",
    "lim": "lim",
    "claimed_until": "CASE WHEN claimed_until > now() THEN claimed_until END",
    "lag": "greatest(0, extract(epoch FROM now() - due_at))::float8",
}


def timer_columns(prefix: str = "") -> str:
    """The timer columns as a SELECT list, each named `prefix` + column."""
    return ", ".join(f"{expr} AS {prefix}{name}" for name, expr in _TIMER_FIELDS.items())


TIMER_COLUMNS = timer_columns()

# A message as flowlock_outbox holds it, shown as the OutboxStore says: a pending message whose
# claim has not run out is running (and shows its claim), the next attempt is shown only while
# pending, and `lag` is 0 outside a claim. message_from_row reads these columns.
_HELD = "status = 'pending' AND claimed_until > now()"
_MESSAGE_FIELDS = {
    "key": "instance_id || ':' || version || ':' || n",
    "instance_id": "instance_id",
    "workflow": "workflow",
    "version": "version",
    "n": "n",
    "kind": "kind",
    "payload": "payload",
    "status": f"CASE WHEN {_HELD} THEN 'running' ELSE status END",
    "attempts": "attempts",
    "fencing_token": "fencing_token",
    "last_error": "last_error",
    "next_attempt_at": "CASE WHEN status = 'pending' THEN due_at END",
    "created_at": "created_at",
    "done_at": "done_at",
    "claimed_until": f"CASE WHEN {_HELD} THEN claimed_until END",
    "trace": "trace",
}


def message_columns(lag: str = "0::float8") -> str:
    """The message columns as a SELECT list, `lag` computed by the SQL expression given."""
    fields = [f"{expr} AS {name}" for name, expr in _MESSAGE_FIELDS.items()]
    return ", ".join([*fields, f"{lag} AS lag"])


MESSAGE_COLUMNS = message_columns()

# Anything that runs a query: a pool, a connection, a pooled connection.
Queryable = asyncpg.Pool | asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

_INSTANCES = (
    f"SELECT {INSTANCE_COLUMNS}, {PAUSED_FROM} FROM flowlock_instances WHERE id = ANY($1::text[])"
)
HISTORIES_BY_IDS = f"""
SELECT {HISTORY_COLUMNS}
  FROM flowlock_history WHERE instance_id = ANY($1::text[]) ORDER BY instance_id, version
"""
"""The histories of the ids in $1 (a text array), by instance then version: one statement."""


def json_object(value: Any) -> Mapping[str, Any]:
    """A `data` column's value as a mapping: decoded already, or JSON text."""
    return json.loads(value) if isinstance(value, str) else value  # type: ignore[no-any-return]


def instance_from_row(row: asyncpg.Record) -> Instance:
    """An Instance from a row holding the instance columns."""
    return Instance(
        id=row["id"],
        workflow=row["workflow"],
        state=row["state"],
        version=row["version"],
        data=json_object(row["data"]),
        last_event=row["last_event"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        stay_version=row["stay_version"],
        paused=bool(row.get("paused")),
        # Read with the instance by the reads that feed a decision; a commit's RETURNING
        # leaves it out (False).
        workflow_paused=bool(row.get("workflow_paused")),
        definition_version=row.get("definition_version"),
    )


def timer_from_row(row: asyncpg.Record, prefix: str = "") -> Timer:
    """A Timer from a row holding the timer columns (named `prefix` + column)."""
    return Timer(
        instance_id=row[prefix + "instance_id"],
        workflow=row[prefix + "workflow"],
        event=row[prefix + "event"],
        stay=row[prefix + "stay"],
        due_at=row[prefix + "due_at"],
        n=row[prefix + "n"],
        every=row[prefix + "every"],
        limit=row[prefix + "lim"],
        claimed_until=row[prefix + "claimed_until"],
        lag=row[prefix + "lag"],
    )


def message_from_row(row: asyncpg.Record) -> Message:
    """A Message from a row holding the message columns."""
    return Message(
        key=row["key"],
        instance_id=row["instance_id"],
        workflow=row["workflow"],
        version=row["version"],
        n=row["n"],
        kind=row["kind"],
        payload=json_object(row["payload"]),
        status=row["status"],
        attempts=row["attempts"],
        fencing_token=row["fencing_token"],
        last_error=row["last_error"],
        next_attempt_at=row["next_attempt_at"],
        created_at=row["created_at"],
        done_at=row["done_at"],
        claimed_until=row["claimed_until"],
        trace=row["trace"],
        lag=row["lag"],
    )


def entry_from_row(row: asyncpg.Record, prefix: str = "") -> HistoryEntry:
    """A HistoryEntry from a row holding the history columns (named `prefix` + column)."""
    return HistoryEntry(
        instance_id=row[prefix + "instance_id"],
        version=row[prefix + "version"],
        event=row[prefix + "event"],
        from_state=row[prefix + "from_state"],
        to_state=row[prefix + "to_state"],
        actor=row[prefix + "actor"],
        request_id=row[prefix + "request_id"],
        strategy=row[prefix + "strategy"],
        data=json_object(row[prefix + "data"]),
        at=row[prefix + "at"],
        fencing_token=row[prefix + "fencing_token"],
        payload=json_object(row[prefix + "payload"]),
        definition_version=row.get(prefix + "definition_version"),
    )


async def read_instances(db: Queryable, ids: Sequence[str]) -> dict[str, Instance]:
    """The instances of `ids` that exist, by id: one statement however many ids."""
    return {row["id"]: instance_from_row(row) for row in await db.fetch(_INSTANCES, list(ids))}


async def read_history(db: Queryable, ids: Sequence[str]) -> dict[str, list[HistoryEntry]]:
    """The history of every id in `ids`, oldest first (an empty list for an id with none): one
    statement however many ids."""
    histories: dict[str, list[HistoryEntry]] = {i: [] for i in ids}
    for row in await db.fetch(HISTORIES_BY_IDS, list(ids)):
        histories.setdefault(row["instance_id"], []).append(entry_from_row(row))
    return histories
