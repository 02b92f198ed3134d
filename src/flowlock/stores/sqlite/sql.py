"""The SQLite store's SQL: statement texts, query builders, and how values are encoded."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from flowlock.core.errors import InvalidInput, StoreError
from flowlock.core.models import (
    PAUSE_EVENT,
    RESERVED_EVENTS,
    RESUME_EVENT,
    HistoryEntry,
    Instance,
    InstanceQuery,
)

# Request ids per ``IN (...)`` list: below the 999 bound variables of SQLite builds before 3.32.
IDS_PER_SELECT: Final = 500

INSTANCE_COLUMNS: Final = (
    "id, workflow, state, version, data, last_event, created_at, updated_at, stay_version"
)


def read_columns(table: str) -> str:
    """The columns a read selects from `table` (its name or alias): the stored ones, the
    instance's own pause, and whether its workflow is paused (one row, found by its key)."""
    stored = ", ".join(f"{table}.{c}" for c in INSTANCE_COLUMNS.split(", "))
    return (
        f"{stored}, {table}.paused, EXISTS (SELECT 1 FROM flowlock_workflow_pauses p "
        f"WHERE p.workflow = {table}.workflow), {table}.definition_version"
    )


READ_COLUMNS: Final = read_columns("flowlock_instances")
READ_WIDTH: Final = len(INSTANCE_COLUMNS.split(", ")) + 3
HISTORY_COLUMNS: Final = (
    "instance_id, version, event, from_state, to_state, actor, request_id, strategy, data, at, "
    "fencing_token, payload, definition_version"
)
SELECT_INSTANCE: Final = f"SELECT {READ_COLUMNS} FROM flowlock_instances WHERE id = ?"
SELECT_PRIORS: Final = (
    f"SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = ? AND request_id IN "
)
# A fencing token lower than the last one written is refused like a stale version. The stay
# moves only when the batch changes the state (its last entering entry's version, else NULL);
# the pause only when its last entry is a pause or resume row (1 or 0, else NULL). A fired
# event is written only while its workflow is not paused (an operator's repair always is): a
# fire that read before a workflow's pause loses its compare-and-swap and is refused on re-read.
CAS_UPDATE: Final = (
    "UPDATE flowlock_instances SET state = ?, version = ?, data = ?, last_event = ?, "
    "updated_at = ?, fencing_token = coalesce(?, fencing_token), "
    "stay_version = coalesce(?, stay_version), paused = coalesce(?, paused), "
    "definition_version = coalesce(?, definition_version) "
    "WHERE id = ? AND version = ? "
    "AND (? IS NULL OR coalesce(fencing_token, 0) <= ?) "
    "AND (? OR NOT EXISTS (SELECT 1 FROM flowlock_workflow_pauses p "
    "WHERE p.workflow = flowlock_instances.workflow))"
)
INSERT_HISTORY: Final = (
    f"INSERT INTO flowlock_history ({HISTORY_COLUMNS}) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def history_params(e: HistoryEntry, data: str, payload: str, at: str) -> tuple[Any, ...]:
    """INSERT_HISTORY's parameters for `e`: its data and payload already JSON text, its time
    as stored (the transaction's now for a new row, the archived time for a restored one)."""
    return (
        e.instance_id, e.version, e.event, e.from_state, e.to_state, e.actor, e.request_id,
        e.strategy, data, at, e.fencing_token, payload, e.definition_version,
    )  # fmt: skip


INSERT_CREATE_REQUEST: Final = (
    "INSERT INTO flowlock_create_requests (request_id, instance_id, state, data) "
    "VALUES (?, ?, ?, ?)"
)
# The instance as its create made it (version 1 and stay 1, its first state and data), and the
# create's key (at 12). Its definition version is the one it runs now (a migration moves it).
SELECT_AS_CREATED: Final = (
    "SELECT i.id, i.workflow, r.state, 1, r.data, NULL, i.created_at, i.created_at, 1, 0, 0, "
    "i.definition_version, r.request_id "
    "FROM flowlock_create_requests r JOIN flowlock_instances i ON i.id = r.instance_id"
)
MIGRATIONS_TABLE: Final = (
    "CREATE TABLE IF NOT EXISTS flowlock_schema_migrations ("
    "name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
)


def _where(query: InstanceQuery) -> tuple[str, list[Any]]:
    """`query` as a WHERE clause and its arguments. Timestamps are stored as ISO-8601 UTC text
    of one fixed shape (`timestamp_text`), so comparing the text compares the moments."""
    clauses = ["1 = 1"]
    args: list[Any] = []
    if query.workflow is not None:
        clauses.append("workflow = ?")
        args.append(query.workflow)
    if query.states is not None:
        clauses.append(f"state IN ({', '.join('?' * len(query.states))})")
        args.extend(query.states)
    if query.updated_before is not None:
        clauses.append("updated_at < ?")
        args.append(timestamp_text(query.updated_before))
    if query.updated_after is not None:
        clauses.append("updated_at > ?")
        args.append(timestamp_text(query.updated_after))
    return " AND ".join(clauses), args


def list_statement(query: InstanceQuery, *, after: str | None, limit: int) -> tuple[str, list[Any]]:
    """The SELECT of
    [`SqliteStore.list_instances`][flowlock.stores.sqlite.SqliteStore.list_instances] and its
    arguments."""
    # Why plain "id > ?" and ORDER BY id: TEXT compares with the BINARY collation, byte by
    # byte of the UTF-8, which is code point order (the order the other stores use); the
    # primary key and the (workflow, state, id) index of 003_queries are in that order.
    where, args = _where(query)
    sql = (
        f"SELECT {READ_COLUMNS} FROM flowlock_instances WHERE {where} AND id > ? "
        "ORDER BY id LIMIT ?"
    )
    return sql, [*args, after or "", limit]


def count_statement(query: InstanceQuery) -> tuple[str, list[Any]]:
    """The SELECT of
    [`SqliteStore.count_instances`][flowlock.stores.sqlite.SqliteStore.count_instances] and its
    arguments."""
    where, args = _where(query)
    return f"SELECT count(*) FROM flowlock_instances WHERE {where}", args


def statements_of(script: str) -> list[str]:
    """`script` split into single statements. `executescript` cannot be used: it commits
    the open transaction first, and the migrations must all run inside one."""
    statements: list[str] = []
    buffer = ""
    for piece in script.split(";"):
        buffer += piece + ";"
        # complete_statement knows about string literals, comments and trigger bodies, so a
        # ";" inside one of those does not end the statement.
        if sqlite3.complete_statement(buffer):
            if _has_code(buffer):
                statements.append(buffer)
            buffer = ""
    if _has_code(buffer):
        statements.append(buffer)  # unterminated: let SQLite say what is wrong with it
    return statements


def _has_code(statement: str) -> bool:
    lines = (line.split("--", 1)[0].strip(" \t;") for line in statement.splitlines())
    return any(lines)


# -- encoding ----------------------------------------------------------------------------------


def millis(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def now_text() -> str:
    return timestamp_text(datetime.now(UTC))


def timestamp_text(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def parse_timestamp(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def dump_json(data: Mapping[str, Any], what: str) -> str:
    try:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(
            f"{what} cannot be stored as JSON ({exc}); use only dicts, lists, strings, finite "
            "numbers, booleans and None"
        ) from exc


def load_json(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StoreError(
            f"the stored data of {where} is not valid JSON ({exc}); the row was edited outside "
            "flowlock: repair it by hand"
        ) from exc
    if not isinstance(data, dict):
        raise StoreError(
            f"the stored data of {where} is a JSON {type(data).__name__}, not an object; the row "
            "was edited outside flowlock: repair it by hand"
        )
    return data


def instance_of(row: tuple[Any, ...]) -> Instance:
    return Instance(
        id=row[0],
        workflow=row[1],
        state=row[2],
        version=row[3],
        data=load_json(row[4], f"instance {row[0]!r}"),
        last_event=row[5],
        created_at=parse_timestamp(row[6]),
        updated_at=parse_timestamp(row[7]),
        stay_version=row[8],
        paused=bool(row[9]),
        workflow_paused=bool(row[10]),
        definition_version=row[11],
    )


def is_repair(last: HistoryEntry) -> int:
    """1 when a batch whose last entry is `last` is an operator's repair (it is written through
    a workflow's pause), else 0."""
    return int(last.event in RESERVED_EVENTS)


def paused_column(last: HistoryEntry) -> int | None:
    """What a batch whose last entry is `last` writes to the `paused` column: 1 after a pause
    row, 0 after a resume row, None (left as it is) after any other."""
    if last.event == PAUSE_EVENT:
        return 1
    return 0 if last.event == RESUME_EVENT else None


def entry_of(row: tuple[Any, ...]) -> HistoryEntry:
    return HistoryEntry(
        instance_id=row[0],
        version=row[1],
        event=row[2],
        from_state=row[3],
        to_state=row[4],
        actor=row[5],
        request_id=row[6],
        strategy=row[7],
        data=load_json(row[8], f"history entry {row[0]!r} v{row[1]}"),
        at=parse_timestamp(row[9]),
        fencing_token=row[10],
        payload=load_json(row[11], f"payload of history entry {row[0]!r} v{row[1]}"),
        definition_version=row[12],
    )


def histories_of(conn: sqlite3.Connection, ids: list[str]) -> dict[str, list[HistoryEntry]]:
    """The history of each id in `ids`, oldest first (an empty list for one with none), read
    `IDS_PER_SELECT` ids a statement."""
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
    return histories


def is_busy(exc: sqlite3.Error) -> bool:
    # The primary result code is the low byte; BUSY_SNAPSHOT, BUSY_RECOVERY etc. share it.
    code = getattr(exc, "sqlite_errorcode", None)  # absent on errors raised by the module itself
    if isinstance(code, int) and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return True
    return "database is locked" in str(exc)
