"""PostgreSQL store on asyncpg.

- One pool; every hot statement is a fixed SQL text, so asyncpg prepares it once per connection and
  reuses it from its statement cache.
- ``jsonb`` is decoded to dicts and encoded from mappings by a codec set on each new connection.
- The optimistic write is ONE statement: a CTE that compare-and-swaps the instance and appends the
  history row, atomic on its own (no explicit transaction, one round trip).
- The pessimistic path is one transaction: ``SET LOCAL lock_timeout`` in the same round trip as
  ``BEGIN``, ``SELECT ... FOR UPDATE [NOWAIT]`` which also reports the lock_timeout in force (so a
  timeout that did not take effect is caught, the seed article's bug), the request-id lookup as its
  own statement (it must see rows committed while we waited for the lock), the same CAS, COMMIT.
- Driver errors are translated at this adapter's edge (:meth:`PostgresStore._conn`) by the one
  translation of :mod:`flowlock._pg.errors`; this module only says what a lock that is not
  available and a duplicate request id mean to each call, and which statements may commit a
  write (a session lost while one is in flight is OutcomeUnknown, elsewhere ConnectionLost). A
  connection that failed that way is terminated, not given back to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg

from flowlock._pg import migrations
from flowlock._pg.errors import Context, broken, in_doubt, wrap_connect
from flowlock._pg.pool import (
    check_pool_size,
    check_schema,
    close_pool,
    connection,
    create_pool,
    terminate,
)
from flowlock._pg.rows import HISTORY_COLUMNS, INSTANCE_COLUMNS, entry_from_row, instance_from_row
from flowlock.errors import (
    EngineClosed,
    FlowlockError,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockTimeout,
    StoreError,
)
from flowlock.models import Escalation, HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.stores.base import LockedResult, Plan, RowLock

__all__ = ["PostgresStore", "count_statement", "list_statement"]


_READ = f"""
SELECT {INSTANCE_COLUMNS} FROM flowlock_instances WHERE id = $1
"""
# The unlocked read with the request-id lookup in the same snapshot: one round trip.
_READ_WITH_REQUEST = """
SELECT i.id, i.workflow, i.state, i.version, i.data, i.last_event, i.created_at, i.updated_at,
       h.instance_id AS h_instance_id, h.version AS h_version, h.event AS h_event,
       h.from_state AS h_from_state, h.to_state AS h_to_state, h.actor AS h_actor,
       h.request_id AS h_request_id, h.strategy AS h_strategy, h.data AS h_data, h.at AS h_at,
       h.fencing_token AS h_fencing_token, h.payload AS h_payload
FROM flowlock_instances i
LEFT JOIN flowlock_history h ON h.instance_id = i.id AND h.request_id = $2
WHERE i.id = $1
"""
_LOCK = f"""
SELECT {INSTANCE_COLUMNS}, current_setting('lock_timeout') AS lock_timeout
FROM flowlock_instances WHERE id = $1 FOR UPDATE
"""
_LOCK_NOWAIT = _LOCK.rstrip() + " NOWAIT\n"
_PRIOR = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = $1 AND request_id = $2
"""
# Why one statement: the UPDATE's row lock and the INSERT commit together or not at all, and
# the version in the WHERE clause is the compare-and-swap; no row back means another writer won.
# A writer that finds the row locked waits for its holder (at most the session's lock_timeout)
# and re-checks the version against what the holder committed, so a loser learns it lost only
# once the winner is durable: its re-read then sees the winner's row, never a stale one.
# (Measured: returning the winner's row from this statement instead, through a VOLATILE function
# with a fresh snapshot, was slower at p99 than the re-read.)
# A lease's fencing token ($10) lower than the last one written is refused like a stale version.
# $1 id, $2 version read, $3 new state, $4 new data, $5 event, $6 from state, $7 actor,
# $8 request id, $9 strategy, $10 fencing token (NULL outside the distributed strategy),
# $11 the call's payload.
_CAS = f"""
WITH moved AS (
    UPDATE flowlock_instances
       SET state = $3, version = $2 + 1, data = $4, last_event = $5, updated_at = now(),
           fencing_token = coalesce($10, fencing_token)
     WHERE id = $1 AND version = $2
       AND ($10::bigint IS NULL OR coalesce(fencing_token, 0) <= $10)
 RETURNING {INSTANCE_COLUMNS}
), logged AS (
    INSERT INTO flowlock_history (instance_id, version, event, from_state, to_state,
                                  actor, request_id, strategy, data, at, fencing_token, payload)
    SELECT id, version, $5, $6, state, $7, $8, $9, data, updated_at, $10, $11 FROM moved
)
SELECT * FROM moved
"""
# An escalation only ever grows longer; rows long past are pruned by the writers.
_PUBLISH = """
WITH pruned AS (
    DELETE FROM flowlock_escalations WHERE until < now() - interval '1 hour'
)
INSERT INTO flowlock_escalations (key, strategy, until, reason)
VALUES ($1, $2, to_timestamp($3), $4)
ON CONFLICT (key) DO UPDATE
   SET until = greatest(flowlock_escalations.until, excluded.until),
       strategy = excluded.strategy, reason = excluded.reason
"""
_ACTIVE = """
SELECT key, strategy, extract(epoch FROM until)::float8 AS until, reason
  FROM flowlock_escalations WHERE until > to_timestamp($1)
"""
_CREATE = f"""
INSERT INTO flowlock_instances (id, workflow, state, version, data)
VALUES ($1, $2, $3, 1, $4)
ON CONFLICT (id) DO NOTHING
RETURNING {INSTANCE_COLUMNS}
"""
_HISTORY = f"""
SELECT {HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = $1 ORDER BY version
"""


# Workflow and state names are written into a query's text as literals, not passed as
# parameters: asyncpg keeps its statements prepared, and after a few runs PostgreSQL may plan one
# once for any value, estimating "state = $n" as an average state. For a rare state (the pending
# few among millions approved) that plan walks the whole id index instead of the state's own
# range. With the names in the text every (workflow, state) gets its own plan. Only names of the
# shape a Workflow accepts are written, so no quoting can be escaped.
_NAME_LITERAL = re.compile(r"[A-Za-z0-9_.\-]{1,100}")


def _literal(name: str) -> str:
    if not _NAME_LITERAL.fullmatch(name):
        raise InvalidInput(f"{name!r} is not a workflow or state name; nothing was read")
    return f"'{name}'"


def _where(query: InstanceQuery, args: list[object]) -> list[str]:
    """``query`` as WHERE conditions; the arguments of the timestamps are appended to ``args``
    (numbered on from what ``args`` already holds)."""
    conditions: list[str] = []
    if query.workflow is not None:
        conditions.append(f"workflow = {_literal(query.workflow)}")
    if query.states is not None:
        # "= 'x'" for one state, not "IN (...)": the planner sees from an equality that the
        # (workflow, state, id) index range is already in id order.
        names = ", ".join(_literal(state) for state in query.states)
        conditions.append(f"state = {names}" if len(query.states) == 1 else f"state IN ({names})")
    if query.updated_before is not None:
        args.append(query.updated_before)
        conditions.append(f"updated_at < ${len(args)}")
    if query.updated_after is not None:
        args.append(query.updated_after)
        conditions.append(f"updated_at > ${len(args)}")
    return conditions


# COLLATE "C": code point order, the order of the other stores and of the indexes of
# 006_queries.sql. $1 is the cursor ('' is below every id, since ids are never empty: the first
# page), $2 the limit.
_PAGE = 'id COLLATE "C" > $1 ORDER BY id COLLATE "C" LIMIT $2'


def list_statement(
    query: InstanceQuery, *, after: str | None, limit: int
) -> tuple[str, list[object]]:
    """The SELECT of :meth:`PostgresStore.list_instances` and its arguments."""
    args: list[object] = [after or "", limit]
    states = query.states or ()
    if query.workflow is None or len(states) < 2:
        conditions = " AND ".join([*_where(query, args), ""])
        return f"SELECT {INSTANCE_COLUMNS} FROM flowlock_instances WHERE {conditions}{_PAGE}", args
    # Several states of one workflow: one branch per state, each an index range of
    # (workflow, state, id) already in id order, merged (Merge Append) so that a page reads
    # about as many rows as it returns. One "state = ANY(...)" would have to read every row
    # of those states, or walk the whole id index, to find the first ones in id order.
    branches = [
        f"(SELECT {INSTANCE_COLUMNS} FROM flowlock_instances "
        f"WHERE {' AND '.join(_where(dataclasses.replace(query, states=(state,)), args))} "
        f"AND {_PAGE})"
        for state in states
    ]
    merged = " UNION ALL ".join(branches)
    return f'SELECT * FROM ({merged}) AS page ORDER BY id COLLATE "C" LIMIT $2', args


def count_statement(query: InstanceQuery) -> tuple[str, list[object]]:
    """The SELECT of :meth:`PostgresStore.count_instances` and its arguments."""
    args: list[object] = []
    conditions = _where(query, args)
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    return f"SELECT count(*) FROM flowlock_instances{where}", args


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "min": 60_000.0, "h": 3_600_000.0, "d": 86_400_000.0}


def _millis(setting: str) -> float:
    """A PostgreSQL time setting ('200ms', '5s', '1min', '0') in milliseconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", setting.strip())
    if m is None:
        return -1.0
    return float(m.group(1)) * _UNITS.get(m.group(2) or "ms", -1.0)


def _snapshot(row: asyncpg.Record) -> Snapshot:
    """A row of _READ_WITH_REQUEST: the instance and the prior entry for the request id."""
    return Snapshot(
        instance_from_row(row), None if row["h_version"] is None else entry_from_row(row, "h_")
    )


def _cas_args(entry: HistoryEntry) -> tuple[Any, ...]:
    return (
        entry.instance_id,
        entry.version - 1,
        entry.to_state,
        entry.data,
        entry.event,
        entry.from_state,
        entry.actor,
        entry.request_id,
        entry.strategy,
        entry.fencing_token,
        entry.payload,
    )


class PostgresStore:
    """Instances and history in PostgreSQL.

    ``dsn``: a ``postgresql://`` URL. ``pool_size``: connections at most (pessimistic callers hold
    one each while they wait for a row lock). ``acquire_timeout``: seconds to wait for a free
    connection before StoreBusy. ``schema``: put the tables in this schema (created if missing)
    instead of the connection's default. ``auto_migrate``: migrate on open. ``lock_timeout``:
    seconds any statement outside a pessimistic transaction may wait for a row lock (the
    optimistic compare-and-swap waits for a concurrent writer to commit) before LockTimeout.
    ``application_name``: how the connections show in ``pg_stat_activity``.
    """

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int = 20,
        min_size: int = 1,
        acquire_timeout: float = 10.0,
        schema: str | None = None,
        auto_migrate: bool = True,
        connect_timeout: float = 10.0,
        lock_timeout: float = 5.0,
        application_name: str = "flowlock",
    ) -> None:
        check_schema(schema)
        check_pool_size(pool_size)
        self.dsn = dsn
        self.schema = schema
        self.pool_size = pool_size
        self._min_size = min(min_size, pool_size)
        self._acquire_timeout = acquire_timeout
        self._connect_timeout = connect_timeout
        self._auto_migrate = auto_migrate
        self.lock_timeout = lock_timeout
        self.application_name = application_name
        self._pool: asyncpg.Pool | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if self._pool is not None:
            return
        # Every statement outside a pessimistic transaction (the optimistic compare-and-swap
        # above all) waits at most lock_timeout for a row lock: no wait in flowlock is unbounded.
        with wrap_connect(self.dsn):
            self._pool = await create_pool(
                self.dsn,
                min_size=self._min_size,
                max_size=self.pool_size,
                schema=self.schema,
                create_schema=True,
                application_name=self.application_name,
                server_settings={"lock_timeout": f"{max(1, round(self.lock_timeout * 1000))}ms"},
                connect_timeout=self._connect_timeout,
            )
        if self._auto_migrate:
            try:
                await self.migrate()
            except BaseException:
                await self.aclose()
                raise

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await close_pool(pool)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise EngineClosed("the PostgreSQL store is closed; open it first")
        return self._pool

    @asynccontextmanager
    async def _conn(
        self,
        key: str = "",
        *,
        busy: Callable[[BaseException], FlowlockError] | None = None,
        writes: bool = False,
    ) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        """A pooled connection, whose driver errors become flowlock errors about ``key``.
        ``busy``: what a lock that is not available (SQLSTATE 55P03) means to this call; by
        default a StoreError. ``writes``: the block runs one autocommit write, so a session lost
        while it is in flight leaves its outcome unknown (OutcomeUnknown)."""
        context = _errors(key, busy)
        async with connection(
            self.pool,
            acquire_timeout=self._acquire_timeout,
            size=self.pool_size,
            context=replace(context, in_doubt=writes),
        ) as conn:
            yield conn

    async def migrate(self) -> list[str]:
        """Apply the migrations not yet applied; their names (see :mod:`flowlock._pg.migrations`).
        MigrationError if that fails, EngineClosed if the store is not open."""
        return await migrations.migrate(
            self.pool, acquire_timeout=self._acquire_timeout, pool_size=self.pool_size
        )

    # -- operations ------------------------------------------------------------------------

    async def create(self, instance: Instance) -> Instance:
        async with self._conn(instance.id, writes=True) as conn:
            row = await conn.fetchrow(
                _CREATE, instance.id, instance.workflow, instance.state, instance.data
            )
        if row is None:
            raise InstanceExists(instance.id)
        return instance_from_row(row)

    async def get(self, instance_id: str) -> Instance:
        async with self._conn(instance_id) as conn:
            row = await conn.fetchrow(_READ, instance_id)
        if row is None:
            raise InstanceNotFound(instance_id)
        return instance_from_row(row)

    async def read(self, instance_id: str, request_id: str | None) -> Snapshot:
        async with self._conn(instance_id) as conn:
            if request_id is None:
                row = await conn.fetchrow(_READ, instance_id)
            else:
                row = await conn.fetchrow(_READ_WITH_REQUEST, instance_id, request_id)
        if row is None:
            raise InstanceNotFound(instance_id)
        return _snapshot(row) if request_id is not None else Snapshot(instance_from_row(row))

    async def commit(self, entry: HistoryEntry) -> Instance | None:
        key = entry.instance_id
        started = time.monotonic()
        try:
            async with self._conn(
                key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
            ) as conn:
                row = await conn.fetchrow(_CAS, *_cas_args(entry))
        except _DuplicateRequest:
            # The same request id was applied by a concurrent caller; the statement rolled back
            # whole. Report a lost race: the next read finds that entry and answers idempotently.
            return None
        return None if row is None else instance_from_row(row)

    async def apply_locked(
        self, instance_id: str, request_id: str | None, plan: Plan, lock: RowLock
    ) -> LockedResult:
        started = time.monotonic()
        wanted = f"{max(1, round(lock.timeout * 1000))}ms"
        # Why BEGIN and SET LOCAL in one simple-protocol round trip: the timeout must be in
        # force before the FOR UPDATE, and a separate BEGIN would cost a round trip per call.
        begin = "BEGIN" if lock.nowait else f"BEGIN; SET LOCAL lock_timeout = '{wanted}'"

        def busy(_: BaseException) -> FlowlockError:
            if lock.nowait:
                return LockBusy(instance_id)
            return LockTimeout(instance_id, time.monotonic() - started)

        async with self._conn(instance_id, busy=busy) as conn:
            await conn.execute(begin)
            try:
                snap, committed, locked_at = await self._locked_step(
                    conn, instance_id, request_id, plan, lock, wanted
                )
                # A session lost once COMMIT is on its way may have committed: OutcomeUnknown.
                with in_doubt(_errors(instance_id, busy)):
                    await conn.execute("COMMIT")
                released_at = time.monotonic()
            except asyncio.CancelledError:
                # Cancelled mid-statement (waiting for the row lock, say): the connection is
                # busy and cannot take a ROLLBACK. Closing it ends the transaction and frees
                # the lock wait on the server; the pool opens a fresh connection later.
                conn.terminate()
                raise
            except BaseException as exc:
                if broken(exc):
                    # The session is gone (or asyncpg lost track of it): a ROLLBACK would fail
                    # and hide this error; the server rolls back when the socket closes.
                    terminate(conn)
                elif not conn.is_closed() and conn.is_in_transaction():
                    await conn.execute("ROLLBACK")
                raise
        return LockedResult(snap, committed, locked_at - started, released_at - locked_at)

    async def _locked_step(
        self,
        conn: asyncpg.pool.PoolConnectionProxy,
        instance_id: str,
        request_id: str | None,
        plan: Plan,
        lock: RowLock,
        wanted: str,
    ) -> tuple[Snapshot, Instance | None, float]:
        if lock.nowait:
            row = await conn.fetchrow(_LOCK_NOWAIT, instance_id)
        else:
            row = await conn.fetchrow(_LOCK, instance_id)
            if row is not None and _millis(row["lock_timeout"]) != _millis(wanted):
                raise StoreError(
                    f"lock_timeout is {row['lock_timeout']!r} inside the transaction, not "
                    f"{wanted!r}; a pooler or a server setting overrode it, refusing to "
                    "wait unbounded"
                )
        locked_at = time.monotonic()
        if row is None:
            raise InstanceNotFound(instance_id)
        prior = None
        if request_id is not None:
            # Its own statement, so its snapshot is taken after the lock was granted and sees
            # a duplicate request committed while this call waited.
            found = await conn.fetchrow(_PRIOR, instance_id, request_id)
            prior = None if found is None else entry_from_row(found)
        snap = Snapshot(instance_from_row(row), prior)
        entry = plan(snap)
        if entry is None:
            return snap, None, locked_at
        moved = await conn.fetchrow(_CAS, *_cas_args(entry))
        if moved is None:
            raise StoreError(
                f"instance {instance_id!r} changed while its row lock was held; "
                "something bypassed flowlock's locking. Nothing was written"
            )
        return snap, instance_from_row(moved), locked_at

    # -- the adaptive strategy's escalation board (flowlock.stores.base.EscalationBoard) -----

    async def publish(self, escalation: Escalation) -> None:
        async with self._conn(escalation.key, writes=True) as conn:
            await conn.execute(_PUBLISH, escalation.key, escalation.strategy,
                               escalation.until, escalation.reason)  # fmt: skip

    async def active(self, now: float) -> list[Escalation]:
        async with self._conn() as conn:
            rows = await conn.fetch(_ACTIVE, now)
        return [Escalation(r["key"], r["strategy"], r["until"], r["reason"]) for r in rows]

    async def fencing_floor(self, instance_id: str) -> int:
        async with self._conn(instance_id) as conn:
            token = await conn.fetchval(
                "SELECT coalesce(fencing_token, 0) FROM flowlock_instances WHERE id = $1",
                instance_id,
            )
        return int(token or 0)

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        sql, args = list_statement(query, after=after, limit=limit)
        async with self._conn() as conn:
            rows = await conn.fetch(sql, *args)
        return [instance_from_row(r) for r in rows]

    async def count_instances(self, query: InstanceQuery) -> int:
        sql, args = count_statement(query)
        async with self._conn() as conn:
            count = await conn.fetchval(sql, *args)
        return int(count)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        async with self._conn(instance_id) as conn:
            rows = await conn.fetch(_HISTORY, instance_id)
            if not rows and await conn.fetchrow(_READ, instance_id) is None:
                raise InstanceNotFound(instance_id)
        return [entry_from_row(r) for r in rows]


def _errors(key: str, busy: Callable[[BaseException], FlowlockError] | None = None) -> Context:
    """What the driver errors of a statement about ``key`` mean to the store."""
    return Context(
        what=f"PostgreSQL error for {key!r}",
        tables="flowlock tables are",
        opener="the engine",
        key=key,
        busy=busy or _unavailable,
        duplicate=_DuplicateRequest.of,
    )


def _unavailable(exc: BaseException) -> FlowlockError:
    # SQLSTATE 55P03 outside commit and apply_locked (an INSERT waiting behind a concurrent
    # one, say): the lock_timeout of the session ran out.
    return StoreError(str(exc))


class _DuplicateRequest(StoreError):
    """The (instance, request_id) unique constraint fired (a signal commit() catches)."""

    @classmethod
    def of(cls, exc: BaseException) -> FlowlockError:
        return cls(str(exc))
