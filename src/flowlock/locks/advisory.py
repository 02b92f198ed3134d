"""Lease locks on PostgreSQL advisory locks: no Redis needed.

How a lease works
-----------------
A lease is one open transaction on a connection of its own, from acquire to release::

    BEGIN;
    SET LOCAL lock_timeout = '<wait>ms';                         -- the wait bound, on the server
    SET LOCAL idle_in_transaction_session_timeout = '<ttl>ms';   -- the ttl, on the server
    SELECT pg_advisory_xact_lock(<64-bit id of schema/namespace/key>);
    ...                                 -- extend: one trivial statement, restarting the idle timer
    COMMIT;                             -- release: ends the transaction, and with it the lock

- Transaction-level advisory locks only. Session-level locks (``pg_advisory_lock``) outlive the
  transaction and stay with the server connection, so behind a transaction-pooling proxy
  (PgBouncer ``pool_mode=transaction``) they would be left on a connection that the proxy then
  hands to someone else, and an unlock may run on a connection that never held the lock. A
  transaction-level lock ends with its transaction, wherever the connection goes next. (A lease's
  transaction stays open for the whole lease, so through such a proxy each lease still pins one
  server connection; that is the price of the design, not a leak.)
- The ttl is enforced by the server: a holder that stalls, is paused, or loses its network sends
  nothing on the lease's connection, PostgreSQL ends that session after ``ttl`` of idleness, and
  the lock is gone with it. A holder that dies outright loses the lock sooner, as soon as the
  server sees its socket close. ``Lease.expires_at`` stays conservative: it is counted on the local
  clock from before the statement that (re)started the server's idle timer.
- Waiting is done by PostgreSQL's lock queue (no polling); ``wait=0`` uses
  ``pg_try_advisory_xact_lock`` and fails with LockBusy at once.
- The lease's transaction never writes and, in READ COMMITTED, holds no snapshot between
  statements, so it gets no transaction id and does not hold back VACUUM while it is open.

Fencing tokens
--------------
``flowlock_fences`` keeps the highest token handed out per (namespace, key). The increment is
committed on a second connection while the lock is held, and the token is handed out only after
the lease's own connection has answered once more (proof the lock was held during the whole
increment); see :meth:`AdvisoryLocks._next_fence` for why it must not live in the lease's
transaction.

Connections
-----------
Each lease, and each acquire waiting for a lock, holds one connection of a pool of ``pool_size``.
Fencing increments and the read-only queries (``owned``, ``locked``, ``fence_floor``) use a small
second pool, so a holder can always record its token even when waiters fill the first pool. An
acquire that finds no free lease connection within ``wait + pool_timeout`` seconds raises
StoreBusy (a capacity problem, not a busy key: LockBusy / LockTimeout would wrongly say the key is
held). At most ``pool_size + side pool`` connections are open (side pool: a quarter of
``pool_size``, at least 2, at most 8).

The lock's identity is (schema, namespace, key), the same three that name its fencing row: two
deployments in different schemas never block each other, and ``schema=None`` resolves to the
connection's ``current_schema()`` so it names the same lock as an explicit ``schema="public"``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from flowlock._pg.errors import DRIVER_ERRORS, Context, SessionGone, broken, wrap_errors
from flowlock._pg.migrations import migrate_database
from flowlock._pg.pool import (
    check_pool_size,
    check_schema,
    close_pool,
    create_pool,
    give_back,
    terminate,
)
from flowlock.core.errors import (
    EngineClosed,
    FlowlockError,
    LockBusy,
    LockError,
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
    check_application_name,
    check_seconds,
    check_text,
    check_url,
)
from flowlock.locks.base import Lease, LeaseContext, check_lock_key, check_ttl, check_wait

__all__ = ["DEFAULT_IO_TIMEOUT", "AdvisoryLocks", "advisory_lock_id"]

_NAME = "advisory"
DEFAULT_IO_TIMEOUT = 10.0
"""Seconds a round trip of the advisory backend may take (beyond a lock wait it asked for)."""

# $1 namespace, $2 key. Autocommit on the side pool: durable once it returns.
_NEXT_FENCE = """
INSERT INTO flowlock_fences AS f (namespace, key, token) VALUES ($1, $2, 1)
ON CONFLICT (namespace, key) DO UPDATE SET token = f.token + 1
RETURNING token
"""
_FENCE_FLOOR = "SELECT token FROM flowlock_fences WHERE namespace = $1 AND key = $2"
# A bigint advisory lock shows in pg_locks as classid = high 32 bits, objid = low 32 bits,
# objsubid = 1 (the two-int4 form uses objsubid = 2). $1 classid, $2 objid.
_LOCKED = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
     WHERE locktype = 'advisory' AND granted
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1
)
"""
# $1 the lease's server pid, $2 classid, $3 objid.
_HELD_BY = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
     WHERE locktype = 'advisory' AND granted AND pid = $1
       AND classid = $2::bigint::oid AND objid = $3::bigint::oid AND objsubid = 1
)
"""


def advisory_lock_id(scope: str, namespace: str, key: str) -> int:
    """The advisory lock number of ``key``: the first 8 bytes of a BLAKE2b digest of
    (scope, namespace, key), as a signed bigint. Stable across processes, versions and
    platforms (it is part of the on-server protocol: changing it would let an old and a new
    client hold "the same" lock at once)."""
    digest = hashlib.blake2b(
        "\x1f".join((scope, namespace, key)).encode("utf-8"), digest_size=8, person=b"flowlock"
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


def _ms(seconds: float) -> int:
    # Rounded up: the server's bound is never shorter than the one the caller asked for.
    return max(1, math.ceil(seconds * 1000))


def _oids(lock: int) -> tuple[int, int]:
    unsigned = lock & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


def _begin(lock: int, ttl: float, wait_left: float | None) -> str:
    """The first round trip of a lease, as one simple-protocol query. Only numbers are
    interpolated (the key reaches the server as a hash), so there is nothing to inject."""
    idle = f"SET LOCAL idle_in_transaction_session_timeout = '{_ms(ttl)}ms'"
    if wait_left is None:
        # Why a DO block: it raises SQLSTATE 55P03 when the lock is taken, so "busy" comes back
        # as an error in this same round trip (a simple query returns no rows to asyncpg).
        return (
            f"BEGIN; {idle}; DO $$BEGIN IF NOT pg_try_advisory_xact_lock('{lock}'::bigint) THEN "
            "RAISE EXCEPTION USING ERRCODE = 'lock_not_available', "
            "MESSAGE = 'flowlock: advisory lock is held'; END IF; END$$"
        )
    return (
        f"BEGIN; SET LOCAL lock_timeout = '{_ms(wait_left)}ms'; {idle}; "
        f"SELECT pg_advisory_xact_lock('{lock}'::bigint)"
    )


@dataclass(slots=True, eq=False)
class _Slot:
    """A lease's connection. ``guard`` keeps extend / release / owned from overlapping on it."""

    conn: asyncpg.pool.PoolConnectionProxy
    key: str
    lock: int
    pid: int
    guard: asyncio.Lock
    done: bool = False


class AdvisoryLocks(AsyncResource):
    """Lease locks held as PostgreSQL transaction-level advisory locks.

    ``dsn``: a ``postgresql://`` URL. ``namespace``: a prefix separating lock families (and their
    fencing counters) that share a database. ``schema``: where ``flowlock_fences`` lives (the
    same schema as the flowlock store). ``pool_size``: leases and waiting acquires at most, each
    holding a connection. ``auto_migrate``: apply flowlock's migrations on open (the same ones,
    and the same runner, as :class:`~flowlock.stores.postgres.PostgresStore`). ``pool_timeout``:
    seconds beyond ``wait`` an acquire may wait for a free connection before StoreBusy.
    ``io_timeout``: seconds any round trip may take before the server counts as unreachable
    (SessionGone, a LockUnavailable): on top of ``wait`` for an acquire's lock wait, on top of
    the 60 s lock wait of a migration, alone for everything else (release, extend, fencing,
    the queries); ``Engine.connect(command_timeout=...)`` sets it for the backend it builds.
    ``clock`` and ``token`` are injectable for tests.
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

    @property
    def name(self) -> str:
        return _NAME

    def __repr__(self) -> str:
        state = "open" if self._leases is not None else "closed"
        return (
            f"<AdvisoryLocks {self.dsn.split('@')[-1]!r} namespace={self.namespace!r} "
            f"schema={self.schema!r} {state}, {len(self._slots)} held>"
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Migrate (if ``auto_migrate``) and open the pools. Idempotent."""
        async with self._opening:
            if self._leases is not None:
                return
            if self._auto_migrate:
                await self._migrate()
            pools: list[asyncpg.Pool] = []
            try:
                with wrap_errors(_ERRORS):
                    for size, extra in (
                        (self.pool_size, {}),
                        # The only lock the side pool ever waits for is a fencing row, and only
                        # behind a stale holder's increment: a short, bounded wait.
                        (self.side_pool_size, {"lock_timeout": f"{_ms(self._io_timeout)}ms"}),
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
                            )
                        )
                    if self._scope is None:
                        found = await pools[1].fetchval(
                            "SELECT current_schema()", timeout=self._io_timeout
                        )
                        self._scope = found if isinstance(found, str) else ""
            except BaseException:
                for pool in pools:
                    pool.terminate()
                raise
            self._leases, self._side = pools

    async def _migrate(self) -> None:
        # The same runner, on a connection of its own: the pools are not open yet.
        try:
            await migrate_database(
                self.dsn,
                schema=self.schema,
                application_name=self.application_name,
                connect_timeout=self._connect_timeout,
                command_timeout=self._io_timeout,
            )
        except MigrationError:
            raise
        except StoreError as exc:
            # Not a migration failure: the server could not be reached.
            raise LockUnavailable(_NAME, str(exc)) from exc

    async def aclose(self) -> None:
        """Close the pools. Leases still held are ended on the server (their locks freed at
        once); acquires still waiting fail. Idempotent."""
        leases, side = self._leases, self._side
        self._leases = self._side = None
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
        """The advisory lock number of ``key`` (as seen in ``pg_locks``)."""
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
        conn = await self._checkout(leases, wait + self._pool_timeout, self.pool_size)
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
            with wrap_errors(_ERRORS):
                # The server's lock_timeout ends the wait; the client timeout only backs it up.
                await conn.execute(
                    _begin(lock, ttl, left if wait > 0 else None),
                    timeout=max(left, 0) + self._io_timeout,
                )
        except _Busy as exc:
            if wait <= 0:
                raise LockBusy(key) from exc
            raise LockTimeout(key, self._clock() - started) from exc
        fence = await self._next_fence(key)
        sent = self._clock()
        try:
            with wrap_errors(_ERRORS):
                # Proof that the lock was still ours when the increment committed (the session
                # is alive now, and the lock lives as long as the session); also restarts the
                # server's idle timer, from which expires_at is counted.
                await conn.execute("SELECT 1", timeout=self._io_timeout)
        except SessionGone as exc:
            raise LockLost(
                key,
                f"its session ended before the fencing token was handed out ({exc.detail}); "
                "raise the ttl",
            ) from exc
        if self._leases is None:
            raise EngineClosed("the advisory lock backend was closed while acquiring")
        token = self._token()
        self._slots[token] = _Slot(conn, key, lock, conn.get_server_pid(), asyncio.Lock())
        return Lease(key, token, fence, ttl, sent + ttl, _NAME)

    async def _next_fence(self, key: str) -> int:
        """Increment and commit ``key``'s fencing counter, on the side pool, while the lock is
        held (so increments are serialized in lock order).

        Why not in the lease's own transaction: that transaction commits only at release, so a
        holder that died (or whose ttl ran out) would take its increment with it in the rollback,
        and the next holder would be handed the dead holder's number again. That is not safe:
        the point of a fencing token is to be passed to things *outside* this transaction (a
        storage service, an API, a job-runs table written on another connection), which may
        already have accepted writes carrying it; a second holder with an equal token would pass
        their ``token >= highest seen`` checks, and a ``>`` check would lock the rightful new
        holder out instead. Committed first, every token handed out is strictly greater than
        every token handed out before, dead holders' included, and survives a server restart.
        """
        _, side = self._pools()
        conn = await self._checkout(side, self._io_timeout, self.side_pool_size)
        failure: BaseException | None = None
        try:
            with wrap_errors(_ERRORS):
                token = await conn.fetchval(
                    _NEXT_FENCE, self.namespace, key, timeout=self._io_timeout
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
        slot = self._slots.pop(lease.token, None)
        if slot is None or slot.key != lease.key:
            raise LockNotOwned(lease.key, "release")
        leases, _ = self._pools()
        async with slot.guard:
            if slot.done:
                raise LockNotOwned(lease.key, "release")
            failure: BaseException | None = None
            try:
                with wrap_errors(_ERRORS):
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
        slot = self._slots.get(lease.token)
        if slot is None or slot.key != lease.key:
            raise LockNotOwned(lease.key, "extend")
        leases, _ = self._pools()
        async with slot.guard:
            if slot.done:
                raise LockNotOwned(lease.key, "extend")
            sent = self._clock()
            try:
                with wrap_errors(_ERRORS):
                    # Any statement restarts the idle timer; this one also sets a new ttl.
                    await slot.conn.execute(
                        f"SET LOCAL idle_in_transaction_session_timeout = '{_ms(ttl)}ms'",
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
        slot = self._slots.get(lease.token)
        if slot is None or slot.done or slot.key != lease.key:
            return False
        classid, objid = _oids(slot.lock)
        # Asked on the side pool, not on the lease's connection: any statement there would
        # restart the idle timer, and a question must not extend the lease.
        held = await self._query(_HELD_BY, slot.pid, classid, objid)
        return held is True and not slot.done

    async def locked(self, key: str) -> bool:
        classid, objid = _oids(self.lock_id(key))
        return await self._query(_LOCKED, classid, objid) is True

    async def wait_released(self, key: str, wait: float) -> bool:
        """Wait in PostgreSQL's own lock queue (woken by the holder's commit, no polling) until
        the key is free, then let go at once: the lock is held only for that instant, and no
        fencing token is spent."""
        check_lock_key(key)
        check_wait(wait)
        leases, _ = self._pools()
        lock = self.lock_id(key)
        conn = await self._checkout(leases, wait + self._pool_timeout, self.pool_size)
        failure: BaseException | None = None
        try:
            with wrap_errors(_ERRORS):
                await conn.execute(
                    _begin(lock, max(wait, 1.0), wait if wait > 0 else None),
                    timeout=wait + self._io_timeout,
                )
        except _Busy:
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
        """The highest fencing token ever handed out for ``key`` (0 if none): a floor for
        another backend's tokens (the Redis backend's, after Redis lost its data)."""
        check_lock_key(key)
        found = await self._query(_FENCE_FLOOR, self.namespace, key)
        return found if isinstance(found, int) else 0

    # -- connections -----------------------------------------------------------------------

    async def _query(self, sql: str, *args: object) -> object:
        _, side = self._pools()
        conn = await self._checkout(side, self._io_timeout, self.side_pool_size)
        failure: BaseException | None = None
        try:
            with wrap_errors(_ERRORS):
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
            with wrap_errors(_ERRORS):
                return await pool.acquire(timeout=bound)
        except SessionGone as exc:
            if not isinstance(exc.__cause__, TimeoutError):
                raise
            if pool.get_size() >= pool.get_max_size() and pool.get_idle_size() == 0:
                raise StoreBusy(self._clock() - started, size) from None
            # Room in the pool, yet no connection in time: the server did not answer.
            raise LockUnavailable(
                _NAME, f"no connection could be opened within {bound:.1f} s"
            ) from exc

    async def _finish(
        self,
        pool: asyncpg.Pool,
        conn: asyncpg.pool.PoolConnectionProxy,
        *,
        clean: bool,
        error: BaseException | None = None,
    ) -> None:
        """Give a lease connection back to its pool with no transaction open (``error``: what
        the call raised, for :func:`~flowlock._pg.pool.give_back`)."""
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


# -- what driver errors mean here (translated by flowlock._pg.errors) -------------------------


class _Busy(LockError):
    """SQLSTATE 55P03 (lock_timeout, or the try-lock found the lock taken) or 57014."""


# A session that is gone or did not answer is a SessionGone of this backend: the server ended it
# (idle-in-transaction timeout, terminated, restarted), the network failed, or a round trip
# outlived ``io_timeout``.
_ERRORS = Context(
    what="PostgreSQL error in the advisory lock backend",
    tables="flowlock_fences is",
    opener="the advisory lock backend",
    busy=lambda exc: _Busy(str(exc)),
    cancel_is_busy=True,
    lock_backend=_NAME,
)
