"""What the inspection commands (`show`, `history`, `list`, `check`, `timers`, `outbox list`)
read.

They open a database without changing it. Migrations never run, a missing file or schema
is refused, and PostgreSQL sessions are read-only, so even a bug here cannot write. The
repair commands (`outbox retry`, `outbox drop`) open it the same way, but writable.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from flowlock.checker import (
    FINAL_MISMATCH,
    ORPHAN_MESSAGE,
    Verdict,
    Violation,
    check,
    check_holds,
)
from flowlock.checker.constraints import Trail, check_trails, rules_of
from flowlock.core.errors import InstanceNotFound, InvalidInput, MigrationError, StoreError
from flowlock.core.jsondata import same_json
from flowlock.core.migrations import load
from flowlock.core.models import HistoryEntry, Instance, Timer
from flowlock.core.outbox import Message
from flowlock.core.retention import Hold
from flowlock.core.settings import POSTGRES_SCHEMES
from flowlock.engine import Engine, connect
from flowlock.stores.base import OutboxStore, RetentionStore
from flowlock.stores.constraint_store import ConstraintRows, ConstraintStore

if TYPE_CHECKING:  # PostgreSQL is the postgres extra: imported where a URL needs it
    import asyncpg

    from flowlock._pg.pool import SetupHook

__all__ = [
    "CheckReport",
    "check_instances",
    "entry_dict",
    "instance_dict",
    "message_dict",
    "next_timer_dict",
    "open_readonly",
    "timer_dict",
    "walk",
]

_SQLITE_PREFIX = "sqlite:///"
_NAME = "flowlock-inspect"
_CONNECT_TIMEOUT = 10
_MIGRATIONS_TABLE = "flowlock_schema_migrations"
_MIGRATE_HINT = "run `flowlock db migrate` first (these commands never write)"
# Reads of one instance retried while transitions land between them; see _stable_read.
_STABLE_TRIES = 5
_PAGE = 500
_MESSAGE_PAGE = 1000


@asynccontextmanager
async def open_readonly(url: str, schema: str | None = None) -> AsyncIterator[Engine]:
    """An open engine over `url` (`postgresql://` or `sqlite:///path`) that cannot write (and
    runs no timer service: it reads timers, it never fires them).

    Raises InvalidInput for another kind of URL or a bad schema name. Raises StoreError when
    the database cannot be reached or does not exist. Raises MigrationError when flowlock's
    tables are missing or behind this version.
    """
    async with _open(url, schema, writes=False) as engine:
        yield engine


@asynccontextmanager
async def open_for_repair(url: str, schema: str | None = None) -> AsyncIterator[Engine]:
    """An open engine over `url` that may write, for the commands that repair (an operator's
    `outbox retry` and `outbox drop`): refused, and never migrated, as `open_readonly` is.

    It runs no timer service and registers no handler, so it fires nothing and delivers
    nothing: it only makes the engine call it is given. Raises as `open_readonly` does.
    """
    async with _open(url, schema, writes=True) as engine:
        yield engine


@asynccontextmanager
async def _open(url: str, schema: str | None, *, writes: bool) -> AsyncIterator[Engine]:
    scheme = url.partition("://")[0].lower()
    if scheme in POSTGRES_SCHEMES:
        async with _postgres(url, schema, writes=writes) as engine:
            yield engine
    elif scheme == "sqlite":
        if schema is not None:
            raise InvalidInput("--schema applies to PostgreSQL only; a SQLite file has none")
        path = _sqlite_tables(url)
        async with connect(
            _SQLITE_PREFIX + path, auto_migrate=False, max_size=1, timers=False
        ) as engine:
            yield engine
    else:
        raise InvalidInput(
            f"unsupported database url {url.split('@')[-1]!r}: inspect a postgresql://user@host/db "
            "or sqlite:///path/to/file.db database (memory:// holds nothing outside its process)"
        )


@asynccontextmanager
async def _postgres(url: str, schema: str | None, *, writes: bool) -> AsyncIterator[Engine]:
    import asyncpg

    from flowlock._pg.errors import wrap_connect
    from flowlock._pg.pool import check_schema, close_pool
    from flowlock._pg.pooling import probe, session_needed

    check_schema(schema)
    where = url.split("@")[-1] + (f" (schema {schema})" if schema else "")
    # A pool of our own, handed to the engine as an application's pool would be: the store then
    # creates no schema (a CREATE SCHEMA IF NOT EXISTS needs CREATE rights a reader may lack).
    # Its sessions are made read-only with SET: behind a transaction pooler that SET would stay
    # on a server connection the pooler hands to the application next, so it is refused there.
    # A repair's sessions are writable, but refused there too: this pool keeps asyncpg's
    # prepared statements, which a transaction pooler cannot serve.
    setup = _session_in(schema, read_only=not writes)
    with wrap_connect(url):
        pooling = await probe(
            url, application_name=_NAME, connect_timeout=_CONNECT_TIMEOUT, command_timeout=30
        )
        if pooling == "transaction":
            raise session_needed(
                "the outbox repair commands"
                if writes
                else "the inspection commands (read-only sessions)"
            )
        pool = await asyncpg.create_pool(
            url,
            min_size=1,
            max_size=2,
            # Only what a session pooler accepts at startup; the rest is SET on each acquire.
            server_settings={"application_name": _NAME},
            setup=setup,
            timeout=_CONNECT_TIMEOUT,
            command_timeout=30,
        )
    try:
        await _postgres_tables(pool, schema, where)
        async with connect(pool=pool, schema=schema, auto_migrate=False, timers=False) as engine:
            yield engine
    finally:
        await close_pool(pool)


def _session_in(schema: str | None, *, read_only: bool) -> SetupHook | None:
    """What makes every transaction of a connection read-only (and puts `schema` on its
    search_path); set on each acquire. Writable without a schema: nothing to set (None).

    Not a startup setting: `target_session_attrs=read-write` would take a read-only session
    for a standby, so multi-host URLs could never connect, and a session pooler (PgBouncer)
    refuses startup settings it does not know. Not once per connection either: the pool's
    `RESET ALL` on release would undo it.
    """
    path = "" if schema is None else f'SET search_path = "{schema}"; '
    sql = f"{path}SET default_transaction_read_only = on" if read_only else path.strip()
    if not sql:
        return None

    async def on_acquire(conn: asyncpg.pool.PoolConnectionProxy) -> None:
        await conn.execute(sql)

    return on_acquire


async def _postgres_tables(pool: asyncpg.Pool, schema: str | None, where: str) -> None:
    """Refuse a database whose flowlock tables are missing or not up to date."""
    from flowlock._pg.errors import DRIVER_ERRORS

    try:
        async with pool.acquire() as conn:
            if schema is not None and not await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", schema
            ):
                raise MigrationError(
                    f"schema {schema!r} does not exist in {where}; check --schema, or "
                    f"{_MIGRATE_HINT}"
                )
            table = f'"{schema}".{_MIGRATIONS_TABLE}' if schema else _MIGRATIONS_TABLE
            if await conn.fetchval("SELECT to_regclass($1)::text", table) is None:
                raise MigrationError(f"no flowlock tables in {where}; {_MIGRATE_HINT}")
            applied = {row[0] for row in await conn.fetch(f"SELECT name FROM {table}")}
    except DRIVER_ERRORS as exc:
        raise StoreError(f"reading flowlock's tables in {where} failed: {exc}") from exc
    _refuse_pending("postgres", applied, where)


def _sqlite_tables(url: str) -> str:
    """The file path of `url`, once it is known to hold flowlock's tables, up to date."""
    path = url[len(_SQLITE_PREFIX) :] if url.startswith(_SQLITE_PREFIX) else ""
    if not path or "?" in path or "#" in path:
        raise InvalidInput(
            f"unsupported SQLite url {url!r}: expected sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db"
        )
    # sqlite3 would create a missing file: a typo must not leave an empty database behind.
    if not os.path.isfile(path):
        raise StoreError(
            f"no SQLite database at {path!r}; check the path (a new database: {_MIGRATE_HINT})"
        )
    try:
        ro = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True)
        try:
            if not ro.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                (_MIGRATIONS_TABLE,),
            ).fetchone():
                raise MigrationError(f"no flowlock tables in {path!r}; {_MIGRATE_HINT}")
            applied = {row[0] for row in ro.execute(f"SELECT name FROM {_MIGRATIONS_TABLE}")}
        finally:
            ro.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the SQLite database {path!r}: {exc}") from exc
    _refuse_pending("sqlite", applied, repr(path))
    return path


def _refuse_pending(dialect: str, applied: set[str], where: str) -> None:
    pending = [m.name for m in load(dialect) if m.name not in applied]
    if pending:
        raise MigrationError(
            f"{where} lacks flowlock migration(s) {', '.join(pending)}; {_MIGRATE_HINT}"
        )


# -- JSON shapes ------------------------------------------------------------------------------


def _when(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def instance_dict(inst: Instance) -> dict[str, Any]:
    """The instance as JSON-ready values (datetimes as ISO 8601)."""
    return {
        "id": inst.id,
        "workflow": inst.workflow,
        "state": inst.state,
        "version": inst.version,
        "data": dict(inst.data),
        "last_event": inst.last_event,
        "created_at": _when(inst.created_at),
        "updated_at": _when(inst.updated_at),
        "paused": inst.paused,
        "workflow_paused": inst.workflow_paused,
        "definition_version": inst.definition_version,
    }


def next_timer_dict(inst: Instance) -> dict[str, Any] | None:
    """The instance's next timer as `{event, due_at, stay}` (None when none is armed, or when
    the instance was not read by `get`, the one read that fills it in)."""
    nxt = inst.next_timer
    if nxt is None:
        return None
    return {"event": nxt.event, "due_at": _when(nxt.due_at), "stay": nxt.stay}


def timer_dict(timer: Timer) -> dict[str, Any]:
    """One armed timer as JSON-ready values: which firing it is, when it is due (the
    database's clock, ISO 8601) and, when read, how late it is (`lag`, seconds)."""
    return {
        "instance_id": timer.instance_id,
        "workflow": timer.workflow,
        "event": timer.event,
        "stay": timer.stay,
        "n": timer.n,
        "due_at": _when(timer.due_at),
        "lag": round(timer.lag, 6),
        "every": timer.every,
        "limit": timer.limit,
        "claimed_until": _when(timer.claimed_until),
    }


def message_dict(message: Message) -> dict[str, Any]:
    """One outbox message as JSON-ready values: its key and place (the version that emitted
    it, `n` among that transition's messages), where its delivery is, and its payload."""
    return {
        "key": message.key,
        "instance_id": message.instance_id,
        "workflow": message.workflow,
        "version": message.version,
        "n": message.n,
        "kind": message.kind,
        "status": message.status,
        "attempts": message.attempts,
        "last_error": message.last_error,
        "next_attempt_at": _when(message.next_attempt_at),
        "created_at": _when(message.created_at),
        "done_at": _when(message.done_at),
        "claimed_until": _when(message.claimed_until),
        "fencing_token": message.fencing_token,
        "payload": dict(message.payload),
    }


def entry_dict(entry: HistoryEntry) -> dict[str, Any]:
    """One history row as JSON-ready values (datetimes as ISO 8601)."""
    return {
        "instance_id": entry.instance_id,
        "version": entry.version,
        "event": entry.event,
        "from_state": entry.from_state,
        "to_state": entry.to_state,
        "actor": entry.actor,
        "request_id": entry.request_id,
        "strategy": entry.strategy,
        "at": _when(entry.at),
        "fencing_token": entry.fencing_token,
        "data": dict(entry.data),
        "payload": dict(entry.payload),
        "kind": entry.kind,
        "definition_version": entry.definition_version,
    }


# -- reads ------------------------------------------------------------------------------------


async def walk(
    engine: Engine, workflow: str | None, states: Sequence[str] | None, limit: int
) -> tuple[list[Instance], int]:
    """At most `limit` matching instances in id order, read page by page, and the total.

    The total is a separate read, so under concurrent writes it may be off by a few.
    """
    state = list(states) if states else None
    total = await engine.count(workflow=workflow, state=state)
    found: list[Instance] = []
    cursor: str | None = None
    while len(found) < limit:
        page = await engine.list(
            workflow=workflow, state=state, limit=min(_PAGE, limit - len(found)), after=cursor
        )
        found.extend(page)
        cursor = page.next_cursor
        if cursor is None:
            break
    return found, total


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What `flowlock check` found.

    The merged verdict, how many instances, history rows and outbox messages were checked,
    and the ids whose reads never settled. Those were checked on the rows older than them.
    """

    verdict: Verdict
    instances: int
    rows: int
    unsettled: tuple[str, ...]
    messages: int = 0
    holds: int = 0
    slot_events: int = 0
    rate_events: int = 0


async def check_instances(engine: Engine, instance_id: str | None) -> CheckReport:
    """Run the exactly-once checker over one instance, or all of them, page by page. An
    instance made by a create under an idempotency key is checked against the key's record:
    its history starts from the state it was created in, or, with no history, it still holds
    the state and data it was created with.

    Raises InstanceNotFound if the one instance does not exist.
    """
    found: list[Violation] = []
    instances = rows = messages = 0
    unsettled: list[str] = []
    # Each row is held to the rules of the version it records (a row applied under another
    # version's rules shows), from the stored definitions: one read for the whole check.
    forms: dict[str, dict[int, Mapping[str, Any]]] = {}
    for stored in await engine.definitions():
        forms.setdefault(stored.workflow, {})[stored.version] = stored.definition
    # The constraints are read before the instances, so every event names a commit the
    # histories read next hold (see _constraints).
    store, claims = engine.store, None
    if isinstance(store, ConstraintStore) and instance_id is None:
        claims = await store.constraint_rows()
    trails: dict[str, Trail] = {}

    async def one(inst_id: str) -> None:
        nonlocal instances, rows, messages
        read = await _stable_read(engine, inst_id)
        inst, history = read.instance, read.history
        instances += 1
        rows += len(history)
        messages += len(read.messages or ())
        if not read.settled:
            unsettled.append(inst_id)
        # An instance made by a create under an idempotency key: the key's record says the
        # state and data it was made with, which its history must start from.
        # A store written before keyed creates has no such record to check.
        lookup = getattr(engine.store, "create_request", None)
        made = None if lookup is None else await lookup(inst_id)
        initial = None if made is None else made[1].state
        verdict = check(
            inst,
            history,
            initial_state=initial,
            timers=read.timers,
            messages=read.messages,
            definitions=forms.get(inst.workflow),
        )
        found.extend(verdict.violations)
        if claims is not None:
            trails[inst_id] = Trail.of(inst, history)
        if made is not None and not history and not same_json(inst.data, made[1].data):
            found.append(
                Violation(
                    FINAL_MISMATCH,
                    f"instance {inst_id!r}: data is {dict(inst.data)!r} but history is empty, "
                    f"and its create (request id {made[0]!r}) made it with {dict(made[1].data)!r}",
                    inst.version,
                )
            )

    if instance_id is not None:
        await one(instance_id)
    else:
        cursor: str | None = None
        while True:
            page = await engine.list(limit=_PAGE, after=cursor)
            for inst in page:
                await one(inst.id)
            cursor = page.next_cursor
            if cursor is None:
                break
        found.extend(await _homeless_messages(engine))
    holds = await _holds(engine) if instance_id is None else []
    found.extend(check_holds(holds))
    if claims is not None:
        found.extend(await _constraints(engine, claims, trails, forms))
    return CheckReport(
        Verdict.of(found),
        instances,
        rows,
        tuple(unsettled),
        messages,
        len(holds),
        0 if claims is None else len(claims.log),
        0 if claims is None else len(claims.rates),
    )


async def _constraints(
    engine: Engine,
    rows: ConstraintRows,
    trails: Mapping[str, Trail],
    forms: Mapping[str, Mapping[int, Mapping[str, Any]]],
) -> list[Violation]:
    """The constraint rules on the rows read before the instances. Read again after: the same
    rows say no claim committed in between, so the instances read are of the rows' moment
    and each slot's holder is judged by its state; else only the trail itself is judged."""
    store = engine.store
    assert isinstance(store, ConstraintStore)
    current = await store.constraint_rows() == rows
    rules = rules_of(forms, engine.registry.runs)
    return check_trails(rows, trails, rules, current=current)


async def _holds(engine: Engine) -> list[Hold]:
    """Every legal hold (none on a store that keeps none). A hold may name an instance that does
    not exist: only its form is checked."""
    if not isinstance(engine.store, RetentionStore):
        return []
    found: list[Hold] = []
    after: str | None = None
    while True:
        page = await engine.holds(after=after, limit=_PAGE)
        found.extend(page)
        if len(page) < _PAGE:
            return found
        after = page[-1].instance_id


@dataclass(frozen=True, slots=True)
class _Read:
    instance: Instance
    history: list[HistoryEntry]
    timers: list[Timer] | None
    messages: list[Message] | None
    settled: bool = True


async def _read_once(engine: Engine, inst: Instance) -> _Read:
    instance_id = inst.id
    history, timers = await engine.history(instance_id), await engine.timers(instance_id)
    # A store without an outbox (a third-party store) has no messages to check.
    messages = await engine.messages(instance_id) if _has_outbox(engine) else None
    return _Read(inst, history, timers, messages)


def _has_outbox(engine: Engine) -> bool:
    return isinstance(engine.store, OutboxStore)


async def _stable_read(engine: Engine, instance_id: str) -> _Read:
    """The instance, its history, its armed timers and its outbox messages as of one version,
    on a live database.

    They are separate reads, so a transition between them would look like a mismatch.
    Reading the instance again and finding the same version proves nothing landed between
    (timers are armed and voided, and messages written, only by the commits that move the
    version). An instance that keeps moving is checked on the rows up to the version last
    read, with the messages of those versions; its timers are not checked (None): they may
    belong to a later stay.
    """
    read = await _read_once(engine, await engine.get(instance_id))
    for _ in range(_STABLE_TRIES):
        after = await engine.get(instance_id)
        if after.version == read.instance.version:
            return dataclasses.replace(read, instance=after)
        read = await _read_once(engine, after)
    version = read.instance.version
    return _Read(
        read.instance,
        [e for e in read.history if e.version <= version],
        None,
        None if read.messages is None else [m for m in read.messages if m.version <= version],
        settled=False,
    )


async def _homeless_messages(engine: Engine) -> list[Violation]:
    """Outbox messages of instances that do not exist, found by walking every message in key
    order (an instance's messages are read with it; these have no instance to be read with).

    Keys begin with their instance's id, so one instance's messages mostly come together: each
    id is looked up once per run of its messages.
    """
    if not _has_outbox(engine):
        return []
    found: list[Violation] = []
    after: str | None = None
    last: tuple[str, bool] | None = None  # the id looked up last, and whether it exists
    while True:
        page = await engine.find_messages(after=after, limit=_MESSAGE_PAGE)
        for message in page:
            if last is None or last[0] != message.instance_id:
                last = (message.instance_id, await _exists(engine, message.instance_id))
            if not last[1]:
                found.append(
                    Violation(
                        ORPHAN_MESSAGE,
                        f"message {message.key!r} ({message.kind!r}, {message.status}) belongs "
                        f"to instance {message.instance_id!r}, which does not exist: no "
                        "transition in any history emitted it",
                        message.version,
                    )
                )
        if len(page) < _MESSAGE_PAGE:
            return found
        after = page[-1].key


async def _exists(engine: Engine, instance_id: str) -> bool:
    try:
        await engine.get(instance_id)
    except InstanceNotFound:
        return False
    return True
