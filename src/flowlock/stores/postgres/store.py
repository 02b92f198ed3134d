"""The facade: [`PostgresStore`][flowlock.stores.postgres.store.PostgresStore], which builds the
pool and routes each call."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import asyncpg

from flowlock._batching import Coalescer
from flowlock._pg import migrations
from flowlock._pg.errors import (
    DRIVER_ERRORS,
    broken,
    cannot_connect,
    in_doubt,
    wrap_connect,
    wrap_errors,
)
from flowlock._pg.fence import PostgresFenceEpochs
from flowlock._pg.pool import check_schema, close_pool, create_pool
from flowlock._pg.pooling import Pooling, resolve, session_needed
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.errors import EngineClosed, FlowlockError, InvalidInput
from flowlock.core.models import (
    Escalation,
    HistoryEntry,
    Instance,
    InstanceQuery,
    Snapshot,
    Timing,
)
from flowlock.core.settings import (
    DEFAULT_ACQUIRE_TIMEOUT,
    DEFAULT_APPLICATION_NAME,
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX_SIZE,
    DEFAULT_MIN_SIZE,
    POSTGRES_SCHEMES,
    PoolingChoice,
    check_application_name,
    check_flag,
    check_pooling,
    check_seconds,
    check_size,
    check_url,
)
from flowlock.stores.base import LockedResult, Plan, RowLock, Store, entries_of
from flowlock.stores.postgres import pipeline
from flowlock.stores.postgres.constraints import ConstraintMethods
from flowlock.stores.postgres.definitions import DefinitionMethods
from flowlock.stores.postgres.operations import CallerTransaction, Operations, batches_of
from flowlock.stores.postgres.outbox import OutboxMethods
from flowlock.stores.postgres.pauses import PauseMethods
from flowlock.stores.postgres.pipeline import DEPTH, MAX_BATCH, LockedCall
from flowlock.stores.postgres.refusals import Answer, Aside, commit_refusing, settle
from flowlock.stores.postgres.replay import ReplayMethods
from flowlock.stores.postgres.retention import RetentionMethods
from flowlock.stores.postgres.session import (
    Session,
    caller_connection,
    context_of,
    enter,
    leave,
    roll_back,
    undo,
)
from flowlock.stores.postgres.sql import Batch, keys_text, pg_interval, qualified
from flowlock.stores.postgres.timers import TimerMethods

__all__ = ["PostgresStore"]

log = logging.getLogger("flowlock")

T = TypeVar("T")


class PostgresStore(
    TimerMethods,
    OutboxMethods,
    PauseMethods,
    RetentionMethods,
    ReplayMethods,
    DefinitionMethods,
    ConstraintMethods,
):
    """Instances, history, timers and the outbox in PostgreSQL.

    `dsn`: a `postgresql://` URL; flowlock builds its pool, of at most `pool_size`
    connections (pessimistic callers hold one each while they wait for a row lock), `min_size`
    of them opened up front, each opened within `connect_timeout` seconds and shown in
    `pg_stat_activity` as `application_name`. Or `pool`: an application's own asyncpg pool
    instead, which flowlock uses as it is (no codec, setting or search_path of its connections
    changes) and does not close.

    `pipeline` (on by default, flowlock's own pool only): the unlocked reads and the
    compare-and-swaps of calls on different instances that become ready while a few such round
    trips are already in flight are sent together, one statement for many instances, each
    instance's compare-and-swap still standing alone (see
    [`commit_many`][flowlock.stores.postgres.store.PostgresStore.commit_many]); so do the
    pessimistic calls, a group in one transaction that locks its rows with SKIP LOCKED and never
    waits (a call whose row is held elsewhere runs alone afterwards, with its own lock bound). An
    idle store sends each at once.

    `acquire_timeout`: seconds to wait for a free connection before StoreBusy. `schema`: put
    the tables in this schema (created if missing) instead of the connection's default.
    `auto_migrate`: migrate on open. `lock_timeout`: seconds any statement outside a
    pessimistic transaction may wait for a row lock (the optimistic compare-and-swap waits for a
    concurrent writer to commit) before LockTimeout. `command_timeout`: seconds one round trip
    may take on the client's clock beyond that lock wait (a pessimistic FOR UPDATE: beyond the
    strategy's lock_timeout); past it the connection is terminated and the call raises
    ConnectionLost, or OutcomeUnknown when a write may have been sent. `round_trip` is
    the resulting bound of an ordinary statement.

    [`in_transaction`][flowlock.stores.postgres.store.PostgresStore.in_transaction] runs the store's
    statements inside a transaction the caller opened on a connection of its own
    (`engine.fire(..., connection=conn)`).

    `pooling`: what sits between flowlock and PostgreSQL. `"auto"` (the default) finds out
    once, when the store opens, before its pool is built (see `flowlock._pg.pooling.probe`: one
    connection and one query when the link is direct, two connections and a few queries behind
    a pooler). `"session"`: a direct connection or session pooling, no probe. `"transaction"`:
    a transaction pooler (PgBouncer `pool_mode=transaction`), no probe; say so where the probe
    cannot tell (a busy pooler). Behind a transaction pooler the pool keeps no session setting
    and no prepared statement: the statements name the tables with `schema`, the writes that
    may wait for a row lock run in a transaction of their own with `lock_timeout` set LOCAL,
    and the fencing epochs are refused (they need a session). With `pool=` nothing is
    probed: `"transaction"` only refuses the epochs.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: asyncpg.Pool | None = None,
        pool_size: int = DEFAULT_MAX_SIZE,
        min_size: int = DEFAULT_MIN_SIZE,
        acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
        schema: str | None = None,
        auto_migrate: bool = True,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        application_name: str = DEFAULT_APPLICATION_NAME,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        pipeline: bool = True,
        pooling: PoolingChoice = "auto",
    ) -> None:
        check_schema(schema)
        check_flag("pipeline", pipeline)
        self._pooling_choice = check_pooling(pooling)
        if (dsn is None) == (pool is None):
            raise InvalidInput(
                "PostgresStore takes a postgresql:// dsn or an application's asyncpg pool "
                "(pool=...): one of the two"
            )
        if pool is not None and not isinstance(pool, asyncpg.Pool):
            raise InvalidInput(f"pool= takes an asyncpg.Pool, not {type(pool).__name__}")
        if dsn is not None:
            check_url("dsn", dsn, POSTGRES_SCHEMES)
        check_size("pool_size", pool_size)
        check_size("min_size", min_size, least=0)
        self.acquire_timeout = check_seconds("acquire_timeout", acquire_timeout)
        self._connect_timeout = check_seconds("connect_timeout", connect_timeout)
        self.lock_timeout = check_seconds("lock_timeout", lock_timeout)
        self.command_timeout = check_seconds("command_timeout", command_timeout)
        # Any statement may wait lock_timeout for a lock on the server (a row lock for a write,
        # a table lock behind a migration): the client waits that long and command_timeout more.
        self.round_trip = self.lock_timeout + self.command_timeout
        self.application_name = check_application_name(application_name)
        self.dsn = dsn
        self.schema = schema
        self._given = pool
        self.pool_size = pool_size if pool is None else pool.get_max_size()
        self._min_size = min(min_size, pool_size)
        self._auto_migrate = auto_migrate
        self._pool: asyncpg.Pool | None = None
        # What the pool's connections keep from one transaction to the next (set on open):
        # behind a transaction pooler, nothing.
        self._pooling: Pooling | None = None
        self._session_needs: list[str] = []
        self._begin = "BEGIN"
        self._transaction_pooled = False
        self._schema_in_sql: str | None = None
        self._ops = Operations(Session(self))
        # Pipelining (flowlock's own pool only: an application's pool runs a call's statements
        # in a transaction of their own): reads and compare-and-swaps of calls on different
        # instances that are ready while others are in flight go together in one round trip.
        self._reads: Coalescer[tuple[str, str | None], Snapshot] | None = None
        self._writes: Coalescer[Batch, Instance | None] | None = None
        # ... and so do the pessimistic calls, each group in one transaction.
        self._locked: Coalescer[LockedCall, LockedResult] | None = None
        if pipeline and pool is None:
            depth = max(1, min(DEPTH, pool_size // 2))
            self._reads = Coalescer(self._read_together, depth=depth, max_batch=MAX_BATCH)
            self._writes = Coalescer(self._commit_together, depth=depth, max_batch=MAX_BATCH)
            self._locked = Coalescer(self._apply_locked_together, depth=depth, max_batch=MAX_BATCH)
        # Qualified with the schema: an application's pool does not have it on search_path.
        self._fence_epochs = PostgresFenceEpochs(
            lambda: self.pool,
            schema=schema,
            acquire_timeout=self.acquire_timeout,
            size=self.pool_size,
            pooled=lambda: self._pooling == "transaction",
        )
        # flowlock's settings for a transaction on a connection it does not own.
        self._settings = f"SET LOCAL lock_timeout = '{pg_interval(self.lock_timeout)}'"
        if schema is not None:
            self._settings += f'; SET LOCAL search_path = "{schema}"'

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def owns_pool(self) -> bool:
        """Whether flowlock built the pool (and closes it), or the application gave it."""
        return self._given is None

    @property
    def pooling(self) -> Pooling | None:
        """What sits between this store and PostgreSQL, as found (or told) on open: `"none"`
        (a direct connection), `"session"` or `"transaction"` pooling; None before open. On an
        application's pool nothing is probed: `"transaction"` when told so, else `"none"`."""
        return self._pooling

    def needs_session(self, what: str) -> None:
        """Record that `what` (the fencing epochs, lent to a Redis lock backend) needs a
        session of its own: `open` then refuses a transaction pooler with InvalidInput."""
        self._session_needs.append(what)

    async def open(self) -> None:
        if self._pool is not None:
            return
        if self._given is not None:
            if self._given.is_closing():
                raise InvalidInput("the asyncpg pool given as pool= is closed")
            self._set_pooling("transaction" if self._pooling_choice == "transaction" else "none")
            self._pool = self._given
        else:
            dsn = self.dsn or ""
            pooling = await self._find_pooling(dsn)
            self._set_pooling(pooling)
            self._pool = await self._create_pool(dsn, pooling)
        if self._auto_migrate:
            try:
                await self.migrate()
            except BaseException:
                await self.aclose()
                raise

    async def _find_pooling(self, dsn: str) -> Pooling:
        """What sits between this store and PostgreSQL: as told, or probed. A store with
        `min_size=0` opens no connection up front, so that it opens while PostgreSQL is out of
        reach (mid-failover): there a failed probe is no failure, and the pool is built for a
        direct connection or session pooling, which a warning says."""
        try:
            return await resolve(
                self._pooling_choice,
                dsn,
                application_name=self.application_name,
                connect_timeout=self._connect_timeout,
                command_timeout=self.command_timeout,
            )
        except DRIVER_ERRORS as exc:
            if self._min_size > 0:
                raise cannot_connect(exc, dsn) from exc
            log.warning(
                "flowlock: could not find out whether a pooler sits in front of PostgreSQL "
                "(%s); with min_size=0 the store opens anyway, for a direct connection or "
                "session pooling. Behind PgBouncer pool_mode=transaction pass "
                "pooling='transaction'",
                exc,
            )
            return "session"

    def _set_pooling(self, pooling: Pooling) -> None:
        """Refuse what needs a session behind a transaction pooler, else settle how statements
        and transactions are written for `pooling`."""
        if pooling == "transaction" and self._session_needs:
            raise session_needed(" and ".join(dict.fromkeys(self._session_needs)))
        self._pooling = pooling
        transaction_pooled = pooling == "transaction" and self._given is None
        self._transaction_pooled = transaction_pooled
        # No search_path on such connections: the tables are named with the schema.
        self._schema_in_sql = self.schema if transaction_pooled else None
        self._begin = (
            f"BEGIN; SET LOCAL lock_timeout = '{pg_interval(self.lock_timeout)}'"
            if transaction_pooled
            else "BEGIN"
        )

    @property
    def begin(self) -> str:
        """What opens a transaction of flowlock's on its own pool."""
        return self._begin

    def statement(self, sql: str) -> str:
        """`sql` with the tables named with the schema where the connections do not have it
        on their search_path (behind a transaction pooler)."""
        schema = self._schema_in_sql
        return sql if schema is None else qualified(sql, schema)

    async def _create_pool(self, dsn: str, pooling: Pooling) -> asyncpg.Pool:
        # Every statement outside a pessimistic transaction (the optimistic compare-and-swap
        # above all) waits at most lock_timeout for a row lock: no wait in flowlock is unbounded.
        # Behind a transaction pooler that setting cannot outlive a transaction: _call sets it
        # LOCAL around each statement that may wait.
        with wrap_connect(dsn):
            return await create_pool(
                dsn,
                min_size=self._min_size,
                max_size=self.pool_size,
                schema=self.schema,
                create_schema=True,
                application_name=self.application_name,
                server_settings={"lock_timeout": pg_interval(self.lock_timeout)},
                connect_timeout=self._connect_timeout,
                # For asyncpg's own statements; flowlock's pass timeout=round_trip each.
                command_timeout=self.round_trip,
                pooling=pooling,
            )

    async def aclose(self) -> None:
        """Close flowlock's pool; an application's pool (`pool=`) is left open, only no longer
        used."""
        for coalescer in (self._reads, self._writes, self._locked):
            if coalescer is not None:
                await coalescer.drain()
        pool, self._pool = self._pool, None
        self._pooling = None
        if pool is not None and self._given is None:
            await close_pool(pool)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise EngineClosed("the PostgreSQL store is closed; open it first")
        return self._pool

    @property
    def fence_epochs(self) -> PostgresFenceEpochs:
        """The fencing epochs of Redis lock keys, in this store's `flowlock_fence_epochs`: give
        them to [`RedisLocks`][flowlock.locks.redis.RedisLocks] (`fence_epochs=`) for tokens that
        never repeat across Redis data losses (`Engine.connect` does)."""
        return self._fence_epochs

    async def migrate(self) -> list[str]:
        """Apply the migrations not yet applied; their names (see `flowlock._pg.migrations`).
        MigrationError if that fails, EngineClosed if the store is not open."""
        return await migrations.migrate(
            self.pool,
            acquire_timeout=self.acquire_timeout,
            pool_size=self.pool_size,
            command_timeout=self.command_timeout,
            # An application's connections keep their search_path, and a transaction pooler's
            # keep nothing: the schema is set for the migration's transaction only.
            schema=self.schema if self._given is not None or self._schema_in_sql else None,
        )

    # -- where a call's statements run ------------------------------------------------------

    async def _call(
        self,
        op: Callable[[Operations], Awaitable[T]],
        key: str = "",
        *,
        waits: bool = True,
        writes: bool = False,
        own: bool = False,
    ) -> T:
        """`op` on flowlock's pool; on an application's pool, in a transaction of its own
        when it may wait for a lock or needs the schema on search_path. `key`: what the
        errors of that transaction's own statements quote; `writes`: `op` may write, so a
        session lost while its COMMIT is in flight leaves the outcome unknown. Behind a
        transaction pooler, flowlock's pool too runs `op` in a transaction of its own when it
        may wait for a lock, for the lock_timeout no session keeps there, unless `op` opens a
        transaction itself (`own`) that sets it."""
        if self._given is None:
            if waits and not own and self._transaction_pooled:
                async with self._app_transaction(key, writes=writes) as ops:
                    return await op(ops)
            return await op(self._ops)
        if not waits and self.schema is None:
            return await op(self._ops)
        async with self._app_transaction(key, writes=writes) as ops:
            return await op(ops)

    @asynccontextmanager
    async def _app_transaction(
        self, key: str = "", *, writes: bool = False
    ) -> AsyncIterator[Operations]:
        """A connection of the pool (the application's, or flowlock's behind a transaction
        pooler) in a transaction of flowlock's, with flowlock's lock_timeout and schema set
        LOCAL: they end with it, and the connection goes back to the pool as it came (or is
        terminated, when its session failed under it)."""
        async with Session(self).conn(key) as conn:
            await conn.execute(f"BEGIN; {self._settings}", timeout=self.round_trip)
            try:
                yield Operations(Session(self, joined=conn))
                with in_doubt(context_of(key)) if writes else contextlib.nullcontext():
                    await conn.execute("COMMIT", timeout=self.round_trip)
            except asyncio.CancelledError:
                conn.terminate()  # it may be mid-statement: see _own_transaction
                raise
            except BaseException as exc:
                await roll_back(conn, exc, self.round_trip)
                raise

    @asynccontextmanager
    async def in_transaction(self, connection: object) -> AsyncIterator[Store]:
        """This store on `connection` (an asyncpg connection inside a transaction the caller
        opened and will commit or roll back), for the length of the `async with`.

        Everything runs in a savepoint with flowlock's `lock_timeout` and `schema` set for
        it. On an error inside, flowlock's part is rolled back to the savepoint (its settings
        with it) and the caller's transaction goes on, usable; on the way out the caller's own
        `search_path` and `lock_timeout` are put back. Cancelled mid-statement, the
        connection is left to the caller (roll the transaction back). InvalidInput, before any
        statement, when `connection` is not an open asyncpg connection in a transaction (or in
        one that has already failed)."""
        conn = caller_connection(connection)
        context = context_of("")
        with wrap_errors(context):
            prior = await enter(conn, self._settings, self.round_trip)
        try:
            yield CallerTransaction(Session(self, joined=conn, callers=True))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # A connection whose session failed cannot take the rollback to the savepoint (it
            # would only hide this error behind its own): the caller's transaction is lost with
            # it, and the connection is the caller's to close or give back.
            if not broken(exc):
                await undo(conn, self.round_trip)
            raise
        with wrap_errors(context):
            await leave(conn, prior, self.round_trip)

    # -- operations ------------------------------------------------------------------------

    async def create(
        self,
        instance: Instance,
        request_id: str | None = None,
        arm: Sequence[Timing] = (),
        claims: Sequence[Claim] = (),
    ) -> Instance:
        return await self._call(
            lambda ops: ops.create(instance, request_id, arm, claims), instance.id, writes=True
        )

    async def create_request(self, instance_id: str) -> tuple[str, Instance] | None:
        return await self._call(
            lambda ops: ops.create_request(instance_id), instance_id, waits=False
        )

    async def get(self, instance_id: str) -> Instance:
        return await self._call(lambda ops: ops.get(instance_id), instance_id, waits=False)

    async def read(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        reads, ids = self._reads, tuple(dict.fromkeys(request_ids))
        if reads is None or len(ids) > 1:
            return await self._call(
                lambda ops: ops.read(instance_id, ids), instance_id, waits=False
            )
        # One call's read: several instances' go together in one round trip (READ_MANY).
        return await reads.submit((instance_id, next(iter(ids), None)), self._read_one)

    async def _read_one(self, call: tuple[str, str | None]) -> Snapshot:
        instance_id, request_id = call
        return await self._ops.read(instance_id, () if request_id is None else (request_id,))

    async def _read_together(
        self, calls: Sequence[tuple[str, str | None]]
    ) -> list[Snapshot | FlowlockError]:
        return await self._ops.read_together(calls)

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        batch = entries_of(entries)
        if self._writes is None:
            return await self._commit(batch)
        return await self._writes.submit(batch, self._commit)

    async def _commit_together(
        self, batches: Sequence[Batch]
    ) -> list[Instance | BaseException | None]:
        return await pipeline.commit_in_rounds(batches, self.commit_many)

    async def _commit(self, batch: Batch) -> Instance | None:
        key = batch[0].instance_id
        return await self._call(lambda ops: ops.commit_batch(batch), key, writes=True)

    async def commit_many(
        self, batches: Sequence[Sequence[HistoryEntry]]
    ) -> list[Instance | ConstraintRefused | None]:
        """Every batch checked first (InvalidInput, nothing written), then one statement for
        all of them (see CAS_MANY). When that statement fails whole, on a request id applied
        before or a deadlock or serialization failure, each batch is committed alone, so only
        the batch at fault answers None. A batch whose claim is refused answers its
        ConstraintRefused (nothing of it written) and the statement runs again without it.
        A lock wait past lock_timeout is LockTimeout for all of them; a connection lost while
        the statement was in flight, OutcomeUnknown."""
        checked = batches_of(batches)
        if not checked:
            self.pool  # noqa: B018 - a closed store refuses even an empty commit (EngineClosed)
            return []

        async def together(now: Sequence[Batch]) -> list[Instance | None]:
            return await self._call(
                lambda ops: ops.commit_together(now), keys_text(now), writes=True
            )

        async def recheck(aside: Sequence[Aside]) -> dict[int, Answer]:
            return await self._call(lambda ops: settle(ops.session, aside), waits=False)

        return await commit_refusing(checked, together, self._commit_each, recheck)

    async def _commit_each(
        self, batches: Sequence[Batch]
    ) -> list[Instance | ConstraintRefused | None]:
        # One after another: each locks one row, so they cannot deadlock with anything.
        done: list[Instance | ConstraintRefused | None] = []
        for batch in batches:
            try:
                done.append(await self._commit(batch))
            except ConstraintRefused as exc:
                done.append(exc)
        return done

    async def apply_locked(
        self, instance_id: str, request_ids: Sequence[str], plan: Plan, lock: RowLock
    ) -> LockedResult:
        call = LockedCall(instance_id, tuple(request_ids), plan, lock)
        if self._locked is None:
            return await self._apply_locked_alone(call)
        return await self._locked.submit(call, self._apply_locked_alone)

    async def _apply_locked_alone(self, call: LockedCall) -> LockedResult:
        """A pessimistic call in a transaction of its own, waiting for its row lock as its
        `lock` says."""
        return await self._call(
            lambda ops: ops.apply_locked(call.instance_id, call.request_ids, call.plan, call.lock),
            call.instance_id,
            writes=True,
            own=True,
        )

    async def _apply_locked_together(
        self, calls: Sequence[LockedCall]
    ) -> list[LockedResult | BaseException]:
        return await pipeline.locked_in_groups(
            calls, self._ops.apply_locked_together, self._apply_locked_alone
        )

    async def publish(self, escalation: Escalation) -> None:
        await self._call(lambda ops: ops.publish(escalation), escalation.key, writes=True)

    async def active(self, now: float) -> list[Escalation]:
        return await self._call(lambda ops: ops.active(now), waits=False)

    async def now(self) -> float:
        return await self._call(lambda ops: ops.now(), waits=False)

    async def fencing_floor(self, instance_id: str) -> int:
        return await self._call(
            lambda ops: ops.fencing_floor(instance_id), instance_id, waits=False
        )

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        return await self._call(
            lambda ops: ops.list_instances(query, after=after, limit=limit), waits=False
        )

    async def ping(self) -> None:
        """One round trip on a pool connection, a readiness probe: StoreBusy when no connection
        frees within `acquire_timeout`, ConnectionLost when PostgreSQL does not answer within
        the store's bounds, StoreError when it answers but is read-only (a standby)."""
        await self._call(lambda ops: ops.ping(), waits=False)

    async def count_instances(self, query: InstanceQuery) -> int:
        return await self._call(lambda ops: ops.count_instances(query), waits=False)

    async def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        return await self._call(
            lambda ops: ops.history(instance_id, after=after, limit=limit), instance_id, waits=False
        )
