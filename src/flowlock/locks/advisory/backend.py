"""`AdvisoryLocks`: lease locks held as PostgreSQL transaction-level advisory locks."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS, SessionGone, broken, wrap_errors
from flowlock._pg.migrations import migrate_database
from flowlock._pg.pool import (
    check_pool_size,
    check_schema,
    close_pool,
    create_pool,
    give_back,
    terminate,
)
from flowlock._pg.pooling import Pooling, resolve, session_needed
from flowlock.core.errors import (
    EngineClosed,
    FlowlockError,
    LockBusy,
    LockLost,
    LockNotOwned,
    LockTimeout,
    LockUnavailable,
    MigrationError,
    StoreBusy,
    StoreError,
)
from flowlock.core.lifecycle import AsyncResource
from flowlock.core.settings import (
    MAX_NAMESPACE,
    POSTGRES_SCHEMES,
    PoolingChoice,
    check_application_name,
    check_pooling,
    check_seconds,
    check_text,
    check_url,
)
from flowlock.locks.advisory.bulk import Bulk
from flowlock.locks.advisory.errors import ERRORS, NAME, Busy
from flowlock.locks.advisory.many import BulkCalls
from flowlock.locks.advisory.sql import (
    BULK_SUPPORTED,
    FENCE_FLOOR,
    HELD_BY,
    LOCKED,
    NEXT_FENCE,
    advisory_lock_id,
    begin,
    ms,
    oids,
)
from flowlock.locks.base import (
    Lease,
    LeaseContext,
    check_lock_key,
    check_ttl,
    check_wait,
)

__all__ = ["DEFAULT_IO_TIMEOUT", "NEEDS_SESSION", "AdvisoryLocks"]

DEFAULT_IO_TIMEOUT = 10.0
"""Seconds a round trip of the advisory backend may take (beyond a lock wait it asked for)."""

NEEDS_SESSION = 'advisory locks (locks="advisory")'
"""What the refusal behind a transaction pooler names."""


@dataclass(slots=True, eq=False)
class _Slot:
    """A lease's connection. `guard` keeps extend / release / owned from overlapping on it."""

    conn: asyncpg.pool.PoolConnectionProxy
    key: str
    lock: int
    pid: int
    guard: asyncio.Lock
    done: bool = False


class AdvisoryLocks(BulkCalls, AsyncResource):
    """Lease locks held as PostgreSQL transaction-level advisory locks.

    `dsn`: a `postgresql://` URL.
    `namespace`: a prefix separating lock families (and fencing counters) in one database.
    `schema`: where `flowlock_fences` lives, the flowlock store's schema.
    `pool_size`: leases and waiting acquires at most, each holding a connection.
    `auto_migrate`: apply flowlock's migrations on open, as the PostgreSQL store does.
    `pool_timeout`: seconds beyond `wait` to wait for a connection before StoreBusy.
    `io_timeout`: seconds a round trip may take before the server counts as unreachable.
    It comes on top of an acquire's `wait` and of a migration's 60 s lock wait.
    `Engine.connect(command_timeout=...)` sets it for the backend it builds.
    `pooling`: what sits between this process and PostgreSQL. "auto" (the default) finds out
    on open (`flowlock._pg.pooling.probe`); "session" (a direct connection or session
    pooling) and "transaction" say it. A lease holds its lock for as long as its session
    holds one transaction open, and checks it by that session's process id: behind a
    transaction pooler (PgBouncer `pool_mode=transaction`) `open` refuses with
    InvalidInput, naming session pooling; behind a session pooler it works.
    `bulk`: hold leases on a few shared sessions of the lease pool, so that concurrent acquires,
    releases and renewals on different keys share one statement (PostgreSQL 14 and later; on an
    older server, and with a pool of one connection, every lease has its own session as with
    `bulk=False`). docs/deployment.md says how each lease keeps its own ttl there.
    `clock` and `token` are injectable for tests.
    """

    def __init__(
        self,
        dsn: str,
        *,
        namespace: str = "default",
        schema: str | None = None,
        pool_size: int = 20,
        auto_migrate: bool = True,
        clock: Callable[[], float] = time.monotonic,
        token: Callable[[], str] = lambda: secrets.token_hex(16),
        pool_timeout: float = 2.0,
        io_timeout: float = DEFAULT_IO_TIMEOUT,
        connect_timeout: float = 10.0,
        application_name: str = "flowlock-advisory",
        pooling: PoolingChoice = "auto",
        bulk: bool = True,
    ) -> None:
        # Every argument before any connection: NaN or a negative timeout would otherwise reach
        # a server setting ('1ms', silently) or asyncpg (a raw ValueError at open()).
        check_url("dsn", dsn, POSTGRES_SCHEMES)
        check_text("namespace", namespace, most=MAX_NAMESPACE)
        check_pool_size(pool_size)
        pool_timeout = check_seconds("pool_timeout", pool_timeout, zero=True)
        io_timeout = check_seconds("io_timeout", io_timeout)
        connect_timeout = check_seconds("connect_timeout", connect_timeout)
        check_application_name(application_name)
        check_schema(schema)
        self._pooling_choice = check_pooling(pooling)
        self.dsn = dsn
        self.namespace = namespace
        self.schema = schema
        self.pool_size = pool_size
        self.side_pool_size = max(2, min(8, pool_size // 4))
        self._auto_migrate = auto_migrate
        self._clock = clock
        self._token = token
        self._pool_timeout = pool_timeout
        self._io_timeout = io_timeout
        self._connect_timeout = connect_timeout
        self.application_name = application_name
        self._leases: asyncpg.Pool | None = None
        self._side: asyncpg.Pool | None = None
        self._scope: str | None = schema
        self._slots: dict[str, _Slot] = {}
        self._pending: set[asyncpg.pool.PoolConnectionProxy] = set()
        self._opening = asyncio.Lock()
        # Shared holder sessions: one per batch in flight, taken from the lease pool, which
        # keeps the rest for waiting acquires (none with a pool of one).
        self.holders = 0 if not bulk or pool_size < 2 else min(4, max(1, pool_size // 4))
        self._bulk: Bulk | None = None

    @property
    def name(self) -> str:
        return NAME

    def __repr__(self) -> str:
        state = "open" if self._leases is not None else "closed"
        return (
            f"<AdvisoryLocks {self.dsn.split('@')[-1]!r} namespace={self.namespace!r} "
            f"schema={self.schema!r} {state}, "
            f"{len(self._slots) + len(self._bulk or ())} held>"
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Migrate (if `auto_migrate`) and open the pools. Idempotent."""
        async with self._opening:
            if self._leases is not None:
                return
            pooling = await self._pooling()
            if self._auto_migrate:
                await self._migrate(pooling)
            pools: list[asyncpg.Pool] = []
            try:
                with wrap_errors(ERRORS):
                    for size, extra in (
                        (self.pool_size, {}),
                        # The only lock the side pool ever waits for is a fencing row, and only
                        # behind a stale holder's increment: a short, bounded wait.
                        (self.side_pool_size, {"lock_timeout": f"{ms(self._io_timeout)}ms"}),
                    ):
                        # No jsonb codec: no lease statement reads or writes jsonb.
                        pools.append(
                            await create_pool(
                                self.dsn,
                                min_size=1,
                                max_size=size,
                                schema=self.schema,
                                application_name=self.application_name,
                                server_settings=extra,
                                connect_timeout=self._connect_timeout,
                                # asyncpg's own statements (a release's ROLLBACK, a close's
                                # goodbye); flowlock's pass timeout= each.
                                command_timeout=self._io_timeout,
                                jsonb=False,
                                pooling=pooling,
                            )
                        )
                    if self._scope is None:
                        found = await pools[1].fetchval(
                            "SELECT current_schema()", timeout=self._io_timeout
                        )
                        self._scope = found if isinstance(found, str) else ""
                    bulk = self.holders > 0 and await pools[1].fetchval(
                        BULK_SUPPORTED, timeout=self._io_timeout
                    )
            except BaseException:
                for pool in pools:
                    pool.terminate()
                raise
            self._leases, self._side = pools
            if bulk is True:
                self._bulk = Bulk(self, holders=self.holders, io_timeout=self._io_timeout)

    async def _pooling(self) -> Pooling:
        """What sits between this process and PostgreSQL; InvalidInput when it is a
        transaction pooler, before anything else is opened."""
        with wrap_errors(ERRORS):
            pooling = await resolve(
                self._pooling_choice,
                self.dsn,
                application_name=self.application_name,
                connect_timeout=self._connect_timeout,
                command_timeout=self._io_timeout,
            )
        if pooling == "transaction":
            raise session_needed(NEEDS_SESSION)
        return pooling

    async def _migrate(self, pooling: Pooling) -> None:
        # The same runner, on a connection of its own: the pools are not open yet.
        try:
            await migrate_database(
                self.dsn,
                schema=self.schema,
                application_name=self.application_name,
                connect_timeout=self._connect_timeout,
                command_timeout=self._io_timeout,
                pooling=pooling,
            )
        except MigrationError:
            raise
        except StoreError as exc:
            # Not a migration failure: the server could not be reached.
            raise LockUnavailable(NAME, str(exc)) from exc

    async def aclose(self) -> None:
        """Close the pools. Leases still held are ended on the server (their locks freed at
        once); acquires still waiting fail. Idempotent."""
        leases, side = self._leases, self._side
        self._leases = self._side = None
        bulk, self._bulk = self._bulk, None
        if bulk is not None:
            bulk.close()
        slots = list(self._slots.values())
        self._slots.clear()
        for slot in slots:
            slot.done = True
            terminate(slot.conn)
        # Acquires still waiting for a lock: end their sessions too, or closing the pool would
        # wait for them until their lock_timeout.
        for conn in list(self._pending):
            terminate(conn)
        for pool in (leases, side):
            if pool is not None:
                await close_pool(pool, bound=self._io_timeout)

    def _pools(self) -> tuple[asyncpg.Pool, asyncpg.Pool]:
        if self._leases is None or self._side is None:
            raise EngineClosed("the advisory lock backend is closed; open it first")
        return self._leases, self._side

    def lock_id(self, key: str) -> int:
        """The advisory lock number of `key` (as seen in `pg_locks`)."""
        check_lock_key(key)
        if self._scope is None:
            raise EngineClosed("the advisory lock backend resolves its schema on open")
        return advisory_lock_id(self._scope, self.namespace, key)

    # -- the LockBackend port --------------------------------------------------------------

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        return LeaseContext(self, key, ttl=ttl, wait=wait, clock=self._clock)

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        leases, _ = self._pools()
        lock = self.lock_id(key)
        started = self._clock()
        if self._bulk is not None:
            # The first try shares a statement with the others ready now, bounded as a whole
            # (it may queue behind another); a waiting acquire then waits in PostgreSQL's lock
            # queue on a session of its own.
            bound = wait + self._io_timeout
            try:
                async with asyncio.timeout(bound):
                    lease = await self._bulk.try_one(key, lock, ttl)
            except TimeoutError:  # the try was cancelled: a lease it takes later is given back
                raise LockUnavailable(
                    NAME, f"the first try of {key!r} got no answer within {bound:.1f} s"
                ) from None
            if lease is not None:
                return lease
            if wait <= 0:
                raise LockBusy(key)
        left = max(wait - (self._clock() - started), 0.0)
        conn = await self._checkout(leases, left + self._pool_timeout, self.pool_size)
        self._pending.add(conn)
        try:
            return await self._take(conn, key, lock, ttl, wait, started)
        except BaseException as exc:
            # Shielded: a caller cancelled twice must still not leave the lock or the
            # connection behind. Mid-statement (cancelled, timed out) the connection's state is
            # unknown, so it is closed rather than rolled back; so is a broken one.
            clean = isinstance(exc, FlowlockError) and not broken(exc)
            await asyncio.shield(self._finish(leases, conn, clean=clean, error=exc))
            raise
        finally:
            self._pending.discard(conn)

    async def _take(
        self,
        conn: asyncpg.pool.PoolConnectionProxy,
        key: str,
        lock: int,
        ttl: float,
        wait: float,
        started: float,
    ) -> Lease:
        left = wait - (self._clock() - started)
        try:
            with wrap_errors(ERRORS):
                # The server's lock_timeout ends the wait; the client timeout only backs it up.
                await conn.execute(
                    begin(lock, ttl, left if wait > 0 else None),
                    timeout=max(left, 0) + self._io_timeout,
                )
        except Busy as exc:
            if wait <= 0:
                raise LockBusy(key) from exc
            raise LockTimeout(key, self._clock() - started) from exc
        fence = await self._next_fence(key)
        sent = self._clock()
        try:
            with wrap_errors(ERRORS):
                # Proof that the lock was still ours when the increment committed (the session
                # is alive now, and the lock lives as long as the session); also restarts the
                # server's idle timer, from which expires_at is counted. The process id is the
                # backend's own: a pooler's startup message gives one of its own making.
                pid = await conn.fetchval("SELECT pg_backend_pid()", timeout=self._io_timeout)
        except SessionGone as exc:
            raise LockLost(
                key,
                f"its session ended before the fencing token was handed out ({exc.detail}); "
                "raise the ttl",
            ) from exc
        if self._leases is None:
            raise EngineClosed("the advisory lock backend was closed while acquiring")
        token = self._token()
        self._slots[token] = _Slot(conn, key, lock, int(pid), asyncio.Lock())
        return Lease(key, token, fence, ttl, sent + ttl, NAME)

    async def _next_fence(self, key: str) -> int:
        """Increment and commit `key`'s fencing counter on the side pool, under the lock.

        Holding the lock serializes the increments in lock order.
        Why not in the lease's own transaction: it commits only at release.
        A dead holder's rollback would take its increment along.
        The next holder would then get the dead holder's number again.
        Systems outside this transaction may already have accepted that token.
        An equal token passes their `>=` check; a `>` check locks the new holder out.
        Committed first, every token is strictly greater than all before, and survives restarts.
        """
        _, side = self._pools()
        conn = await self._checkout(side, self._io_timeout, self.side_pool_size)
        failure: BaseException | None = None
        try:
            with wrap_errors(ERRORS):
                token = await conn.fetchval(
                    NEXT_FENCE, self.namespace, key, timeout=self._io_timeout
                )
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await give_back(side, conn, failure)
        if not isinstance(token, int):
            raise StoreError(f"the fencing counter of {key!r} answered {token!r}")
        return token

    async def release(self, lease: Lease) -> None:
        if self._bulk is not None and (kept := self._bulk.kept(lease.token)) is not None:
            if not await self._bulk.release_one(lease):
                # From why its holder's session ended, if it did.
                raise LockNotOwned(lease.key, "release") from kept.holder.error
            return
        slot = self._slots.pop(lease.token, None)
        if slot is None or slot.key != lease.key:
            raise LockNotOwned(lease.key, "release")
        leases, _ = self._pools()
        async with slot.guard:
            if slot.done:
                raise LockNotOwned(lease.key, "release")
            failure: BaseException | None = None
            try:
                with wrap_errors(ERRORS):
                    # Ends the transaction and frees the lock. (If an earlier statement was
                    # cancelled the transaction is aborted and this rolls back: same effect.)
                    await slot.conn.execute("COMMIT", timeout=self._io_timeout)
            except SessionGone as exc:
                # The server ended the session (ttl passed, terminated), or asyncpg found it
                # ended when it tried to send the COMMIT: the lock went with it, and may be
                # someone else's now.
                failure = exc
                raise LockNotOwned(lease.key, "release") from exc
            except BaseException as exc:
                failure = exc
                raise
            finally:
                slot.done = True
                await asyncio.shield(
                    self._finish(leases, slot.conn, clean=failure is None, error=failure)
                )

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        if self._bulk is not None and (kept := self._bulk.kept(lease.token)) is not None:
            renewed = await self._bulk.extend_one(lease, ttl)
            if renewed is None:
                raise LockNotOwned(lease.key, "extend") from kept.holder.error
            return renewed
        slot = self._slots.get(lease.token)
        if slot is None or slot.key != lease.key:
            raise LockNotOwned(lease.key, "extend")
        leases, _ = self._pools()
        async with slot.guard:
            if slot.done:
                raise LockNotOwned(lease.key, "extend")
            sent = self._clock()
            try:
                with wrap_errors(ERRORS):
                    # Any statement restarts the idle timer; this one also sets a new ttl.
                    await slot.conn.execute(
                        f"SET LOCAL idle_in_transaction_session_timeout = '{ms(ttl)}ms'",
                        timeout=self._io_timeout,
                    )
            except asyncio.CancelledError:
                # The lease is still held (Held cancels its watchdog this way just before it
                # releases): keep it. If the server did cancel the statement, the transaction
                # is aborted but still holds the lock; release rolls it back all the same.
                raise
            except Exception as exc:
                # The session ended, did not answer in time, or its transaction was aborted
                # (every driver error is a flowlock error by now): this lease can no longer be
                # kept alive. End it now rather than leave a lock that nobody renews.
                self._slots.pop(lease.token, None)
                slot.done = True
                await asyncio.shield(self._finish(leases, slot.conn, clean=False, error=exc))
                if isinstance(exc, FlowlockError):
                    raise LockNotOwned(lease.key, "extend") from exc
                raise
        return lease.renewed(sent + ttl, ttl)

    async def owned(self, lease: Lease) -> bool:
        if self._bulk is not None and (kept := self._bulk.kept(lease.token)) is not None:
            if kept.key != lease.key or kept.deadline <= self._clock():
                return False
            classid, objid = oids(kept.lock)
            held = await self._query(HELD_BY, kept.holder.pid, classid, objid)
            # Asked again: released, lost or closed during the round trip.
            return held is True and self._bulk is not None and self._bulk.kept(lease.token) is kept
        slot = self._slots.get(lease.token)
        if slot is None or slot.done or slot.key != lease.key:
            return False
        classid, objid = oids(slot.lock)
        # Asked on the side pool, not on the lease's connection: any statement there would
        # restart the idle timer, and a question must not extend the lease.
        held = await self._query(HELD_BY, slot.pid, classid, objid)
        return held is True and not slot.done

    async def locked(self, key: str) -> bool:
        classid, objid = oids(self.lock_id(key))
        return await self._query(LOCKED, classid, objid) is True

    async def wait_released(self, key: str, wait: float) -> bool:
        """Wait in PostgreSQL's lock queue until the key is free, then let go at once.

        The holder's commit wakes it, so there is no polling.
        No fencing token is spent."""
        check_lock_key(key)
        check_wait(wait)
        leases, _ = self._pools()
        lock = self.lock_id(key)
        conn = await self._checkout(leases, wait + self._pool_timeout, self.pool_size)
        failure: BaseException | None = None
        try:
            with wrap_errors(ERRORS):
                await conn.execute(
                    begin(lock, max(wait, 1.0), wait if wait > 0 else None),
                    timeout=wait + self._io_timeout,
                )
        except Busy:
            return False
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await asyncio.shield(
                self._finish(
                    leases, conn, clean=failure is None or not broken(failure), error=failure
                )
            )
        return True

    async def fence_floor(self, key: str) -> int:
        """The highest fencing token ever handed out for `key` (0 if none): a floor for
        another backend's tokens (the Redis backend's, after Redis lost its data)."""
        check_lock_key(key)
        found = await self._query(FENCE_FLOOR, self.namespace, key)
        return found if isinstance(found, int) else 0

    # -- what the bulk path needs ------------------------------------------------------------

    def _now(self) -> float:
        return self._clock()

    def _new_token(self) -> str:
        return self._token()

    async def _holder_connection(self) -> asyncpg.pool.PoolConnectionProxy:
        leases, _ = self._pools()
        return await self._checkout(leases, self._pool_timeout, self.pool_size)

    # -- connections -----------------------------------------------------------------------

    async def _query(self, sql: str, *args: object) -> object:
        _, side = self._pools()
        conn = await self._checkout(side, self._io_timeout, self.side_pool_size)
        failure: BaseException | None = None
        try:
            with wrap_errors(ERRORS):
                return await conn.fetchval(sql, *args, timeout=self._io_timeout)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await give_back(side, conn, failure)

    async def _checkout(
        self, pool: asyncpg.Pool, bound: float, size: int
    ) -> asyncpg.pool.PoolConnectionProxy:
        started = self._clock()
        try:
            with wrap_errors(ERRORS):
                return await pool.acquire(timeout=bound)
        except SessionGone as exc:
            if not isinstance(exc.__cause__, TimeoutError):
                raise
            if pool.get_size() >= pool.get_max_size() and pool.get_idle_size() == 0:
                raise StoreBusy(self._clock() - started, size) from None
            # Room in the pool, yet no connection in time: the server did not answer.
            raise LockUnavailable(
                NAME, f"no connection could be opened within {bound:.1f} s"
            ) from exc

    async def _finish(
        self,
        pool: asyncpg.Pool,
        conn: asyncpg.pool.PoolConnectionProxy,
        *,
        clean: bool,
        error: BaseException | None = None,
    ) -> None:
        """Give a lease connection back to its pool with no transaction open (`error`: what
        the call raised, for `give_back`)."""
        if clean:
            try:
                if conn.is_in_transaction():
                    await conn.execute("ROLLBACK", timeout=self._io_timeout)
            except DRIVER_ERRORS:
                clean = False
        if not clean:
            # Closing the session frees whatever it held; the pool opens a fresh one later.
            terminate(conn)
        await give_back(pool, conn, error)
