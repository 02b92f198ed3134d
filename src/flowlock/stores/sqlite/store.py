"""The SQLite store: stdlib `sqlite3`, one dedicated thread per connection, WAL.

Each connection lives on its own single-thread executor and every public operation is one
synchronous function submitted to that thread which runs a whole transaction (`BEGIN` ..
`COMMIT`). A transaction therefore never spans an `await`: a cancelled caller cannot leave a
connection half-way through a transaction, and the connection is only ever touched by the thread
that created it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, TypeVar

from flowlock.core import migrations
from flowlock.core.admin import WorkflowPause
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.errors import (
    EngineClosed,
    InvalidInput,
    LockBusy,
    LockTimeout,
    MigrationError,
    StoreError,
)
from flowlock.core.lifecycle import AsyncResource
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery, Snapshot, Timing
from flowlock.core.settings import check_count, check_seconds
from flowlock.stores._batch import distinct_batches
from flowlock.stores.base import LockedResult, Plan, RowLock, entries_of
from flowlock.stores.sqlite.constraints import SqliteConstraints
from flowlock.stores.sqlite.definitions import SqliteDefinitions
from flowlock.stores.sqlite.outbox import SqliteOutbox
from flowlock.stores.sqlite.pool import Pool, Worker, stop_workers
from flowlock.stores.sqlite.replay import SqliteReplay
from flowlock.stores.sqlite.retention import SqliteRetention
from flowlock.stores.sqlite.sql import (
    dump_json,
    is_busy,
    millis,
)
from flowlock.stores.sqlite.timer_methods import SqliteTimers
from flowlock.stores.sqlite.timers import get_shown_txn
from flowlock.stores.sqlite.txn import (
    Wake,
    bounded,
    commit_many_txn,
    commit_txn,
    count_txn,
    create_request_txn,
    create_txn,
    encode,
    fence_txn,
    history_txn,
    immediate,
    list_txn,
    locked_txn,
    migrate_txn,
    pause_workflow_txn,
    pauses_txn,
    read_txn,
    resume_workflow_txn,
)

__all__ = ["SqliteStore"]

T = TypeVar("T")
A = TypeVar("A")

_MAX_POOL: Final = 1000
_URL_PREFIX: Final = "sqlite:///"
_URL_FORMS: Final = "sqlite:///relative/path.db, sqlite:////absolute/path.db or sqlite:///:memory:"


class SqliteStore(
    SqliteTimers,
    SqliteOutbox,
    SqliteRetention,
    SqliteReplay,
    SqliteDefinitions,
    SqliteConstraints,
    AsyncResource,
):
    """Instances and history in one SQLite database file.

    Connections: a small pool (`pool_size`, default 4) of connections, each on its own thread,
    so reads run while a write is in progress (WAL mode lets readers and one writer overlap).
    `:memory:` uses a single connection, since each connection to `:memory:` would otherwise
    see its own empty database.

    Locking — read this before choosing the pessimistic strategy on SQLite: SQLite has no row
    locks. `apply_locked` takes the *database-wide* write lock (`BEGIN IMMEDIATE`), so on
    SQLite the pessimistic path serialises every writer of the database, not just writers of one
    instance; `RowLock(nowait=True)` fails with [`LockBusy`][flowlock.LockBusy] whenever *any*
    instance is being written. `commit` (the optimistic path) takes the same lock only for the
    few statements of its compare-and-swap. Within one store, writers queue on an
    `asyncio.Lock` before touching SQLite, so they wait in FIFO order on the event loop
    instead of polling SQLite's busy handler; across processes (or across store objects on the
    same file) the wait is SQLite's busy timeout.

    Bounds: `busy_timeout` (seconds) is the longest any write waits for the write lock, queueing
    in this process included; `RowLock.timeout` can only shorten it for one `apply_locked`.
    `acquire_timeout` bounds the wait for a free connection ([`StoreBusy`][flowlock.StoreBusy]).

    Timers: due times are on this host's wall clock (`time.time()`; SQLite has no server clock),
    written in the transaction of the commit that arms them. `armed()` is set by this store
    object's commits only: an engine in another process sharing the file sees an earlier timer
    armed there when it next looks (at a due time, or within the timer service's idle bound).

    Outbox: messages are written in the commit's transaction, times on the same wall clock.
    `pending()` is set by this store object's commits, and every `outbox_poll` seconds (default
    2) so that a dispatcher here finds another process's messages within that bound.

    Constraints: claims are applied in the commit's write transaction (the write lock
    serializes every key). `slot_releases` hears this store object's releases, and is called
    with ("", "") every second for those of other processes on the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        auto_migrate: bool = True,
        pool_size: int = 4,
        acquire_timeout: float = 30.0,
        outbox_poll: float = 2.0,
    ) -> None:
        try:
            self.path: str = os.fspath(path)
        except TypeError:
            raise InvalidInput(
                f"path must be a str or os.PathLike[str], not {type(path).__name__}"
            ) from None
        if not isinstance(self.path, str):
            raise InvalidInput("path must be a text path (str), not bytes")
        if "\x00" in self.path:
            raise InvalidInput(f"path {self.path!r} contains a NUL character; no file has one")
        self.busy_timeout = check_seconds("busy_timeout", busy_timeout, zero=True)
        # Each connection has a thread of its own: a pool is a handful, never thousands.
        check_count("pool_size", pool_size, most=_MAX_POOL, unit="connections")
        self.auto_migrate = auto_migrate
        self.acquire_timeout = check_seconds("acquire_timeout", acquire_timeout)
        self.outbox_poll = check_seconds("outbox_poll", outbox_poll)
        # Every connection to ":memory:" (or "", a private temporary file) is its own database.
        self.pool_size = 1 if self.path in (":memory:", "") else pool_size
        self._pool: Pool | None = None
        self._lifecycle = asyncio.Lock()
        self._init_timers()
        self._init_outbox()
        self._init_constraints()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        busy_timeout: float = 5.0,
        auto_migrate: bool = True,
        pool_size: int = 4,
        acquire_timeout: float = 30.0,
        outbox_poll: float = 2.0,
    ) -> SqliteStore:
        """A store for `sqlite:///relative/path.db`, `sqlite:////abs/path.db` or
        `sqlite:///:memory:`. Nothing is opened until
        [`open`][flowlock.stores.sqlite.store.SqliteStore.open]."""
        if not isinstance(url, str) or not url.startswith(_URL_PREFIX):
            raise InvalidInput(f"unsupported SQLite url {url!r}: expected {_URL_FORMS}")
        path = url[len(_URL_PREFIX) :]
        if not path or "?" in path or "#" in path:
            raise InvalidInput(
                f"unsupported SQLite url {url!r}: expected {_URL_FORMS} "
                "(a file path after 'sqlite:///', without query string or fragment)"
            )
        return cls(
            path,
            busy_timeout=busy_timeout,
            auto_migrate=auto_migrate,
            pool_size=pool_size,
            acquire_timeout=acquire_timeout,
            outbox_poll=outbox_poll,
        )

    def __repr__(self) -> str:
        state = "open" if self._pool is not None else "closed"
        return f"SqliteStore({self.path!r}, pool_size={self.pool_size}, {state})"

    # -- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the connections (and migrate, when `auto_migrate`). Idempotent."""
        async with self._lifecycle:
            if self._pool is not None:
                return
            workers: list[Worker] = []
            try:
                for _ in range(self.pool_size):
                    workers.append(await self._start_worker())
                pool = Pool(workers)
                if self.auto_migrate:
                    await self._migrate(pool)
            except BaseException:
                await stop_workers(workers)
                raise
            self._pool = pool

    async def aclose(self) -> None:
        """Close every connection and stop its thread, after any transaction in flight on it
        has finished. Idempotent."""
        async with self._lifecycle:
            pool, self._pool = self._pool, None
            if pool is None:
                return
            pool.close()
            await stop_workers(pool.workers)

    async def _start_worker(self) -> Worker:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowlock-sqlite")
        try:
            conn = await asyncio.wrap_future(executor.submit(self._connect))
        except BaseException as exc:
            executor.shutdown(wait=False)
            if isinstance(exc, sqlite3.Error):
                hint = (
                    "another process kept the database locked for longer than busy_timeout; "
                    "retry, or raise busy_timeout"
                    if is_busy(exc)
                    else "check that the directory exists and is writable by this process"
                )
                raise StoreError(
                    f"could not open the SQLite database {self.path!r}: {exc}; {hint}"
                ) from exc
            raise
        return Worker(executor, conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {millis(self.busy_timeout)}")
            conn.execute("PRAGMA foreign_keys = ON")
            self._use_wal(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL, retrying within `busy_timeout`. Why retry here: switching a
        fresh file reads its header and then upgrades to a write lock, and SQLite answers a
        lock upgrade that finds another writer with SQLITE_BUSY at once, without calling the
        busy handler (waiting could deadlock), so two stores opening one new file together
        would fail on the spot instead of waiting for each other."""
        deadline = time.monotonic() + self.busy_timeout
        pause = 0.001
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL").fetchall()
                return
            except sqlite3.OperationalError as exc:
                left = deadline - time.monotonic()
                if not is_busy(exc) or left <= 0:
                    raise
            time.sleep(min(pause, left))  # on the connection's own thread, not the loop's
            pause = min(2 * pause, 0.05)

    def _live(self) -> Pool:
        pool = self._pool
        if pool is None:
            raise EngineClosed(
                f"the SQLite store {self.path!r} is closed; call `await store.open()` "
                "(or use `async with store:`) before using it"
            )
        return pool

    # -- migrations ------------------------------------------------------------------------------

    async def migrate(self) -> list[str]:
        """Apply the SQLite migrations not yet recorded in `flowlock_schema_migrations`, all in
        one `BEGIN IMMEDIATE` transaction (so concurrent starters do not race); returns the
        names applied now."""
        return await self._migrate(self._live())

    async def _migrate(self, pool: Pool) -> list[str]:
        try:
            pending = migrations.load("sqlite")
        except OSError as exc:
            raise MigrationError(
                f"could not read the packaged SQLite migrations: {exc}; reinstall flowlock"
            ) from exc
        started = time.monotonic()
        try:
            await pool.acquire_write(self.busy_timeout)
        except TimeoutError:
            raise MigrationError(
                f"timed out after {time.monotonic() - started:.1f} s waiting for this store's "
                "other writers before migrating; retry, or raise busy_timeout"
            ) from None
        busy_ms = millis(self.busy_timeout - (time.monotonic() - started))
        try:
            return await self._submit(
                pool, bounded(busy_ms, self.busy_timeout, migrate_txn, pending), write=True
            )
        except sqlite3.Error as exc:
            if is_busy(exc):
                raise MigrationError(
                    f"another connection held the write lock of {self.path!r} for more than "
                    f"{self.busy_timeout:.1f} s (busy_timeout), so the schema could not be "
                    "migrated; nothing was applied. Retry, or raise busy_timeout"
                ) from exc
            raise MigrationError(
                f"migrating the SQLite database {self.path!r} failed: {exc}; every migration of "
                "this run was rolled back. Fix the cause (file permissions, disk space, or a "
                "schema edited by hand) and run migrate again"
            ) from exc

    # -- reads -----------------------------------------------------------------------------------

    async def get(self, instance_id: str) -> Instance:
        """The instance as committed, with its earliest armed timer. Raises InstanceNotFound."""
        return await self._read(get_shown_txn, instance_id, what="get")

    async def read(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        """A consistent read (one snapshot) of the instance and the history entries that carry
        `request_ids` (`Snapshot.priors`, by request id)."""
        return await self._read(read_txn, instance_id, request_ids, what="read")

    async def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        """The applied transitions above version `after`, oldest first, at most `limit`.
        Raises InstanceNotFound."""
        return await self._read(history_txn, instance_id, after, limit, what="history")

    async def fencing_floor(self, instance_id: str) -> int:
        """The highest fencing token written for the instance (0 if none)."""
        return await self._read(fence_txn, instance_id, what="fencing_floor")

    async def create_request(self, instance_id: str) -> tuple[str, Instance] | None:
        """The key of the create that made the instance and the instance as it made it."""
        return await self._read(create_request_txn, instance_id, what="create_request")

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        """At most `limit` instances matching `query` with an id after `after`, by id."""
        return await self._read(list_txn, query, after, limit, what="list")

    async def count_instances(self, query: InstanceQuery) -> int:
        """How many instances match `query`."""
        return await self._read(count_txn, query, what="count")

    async def _read(self, txn: Callable[..., T], *args: Any, what: str) -> T:
        pool = self._live()
        try:
            return await self._submit(pool, lambda conn: txn(conn, *args), write=False)
        except sqlite3.Error as exc:
            raise self._error(exc, what) from exc

    # -- writes ----------------------------------------------------------------------------------

    async def create(
        self,
        instance: Instance,
        request_id: str | None = None,
        arm: Sequence[Timing] = (),
        claims: Sequence[Claim] = (),
    ) -> Instance:
        """Insert `instance` at version 1 and stay 1, created and updated now (and its create
        key, and `arm`'s timers, in the same transaction). Raises InstanceExists. A key recorded
        before answers the instance as its first create made it (see
        [`Store.create`][flowlock.stores.base.Store.create])."""
        data = dump_json(instance.data, f"data of instance {instance.id!r}")
        timings, claimed = tuple(arm), tuple(claims)
        return await self._write(
            instance.id,
            lambda conn, wake: create_txn(conn, instance, data, request_id, timings, claimed, wake),
            bound=self.busy_timeout,
            nowait=False,
            what="create",
        )

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        """Compare-and-swap the instance from the first entry's `version - 1` to the last entry
        and append every entry, in one transaction. None when the version moved, a newer fencing
        token was written or one of the request ids was applied meanwhile (nothing written)."""
        batch = encode(entries_of(entries))
        return await self._write(
            batch.instance_id,
            lambda conn, wake: commit_txn(conn, batch, wake),
            bound=self.busy_timeout,
            nowait=False,
            what="commit",
        )

    async def commit_many(
        self, batches: Sequence[Sequence[HistoryEntry]]
    ) -> list[Instance | ConstraintRefused | None]:
        """Every batch's compare-and-swap in one write transaction (SQLite's one round trip):
        one that loses is None at its place and leaves no row, one whose claim is refused its
        ConstraintRefused (its writes rolled back to a savepoint), the others commit. Raises
        InstanceNotFound (nothing written) when one of the instances does not exist."""
        encoded = [encode(batch) for batch in distinct_batches(batches)]
        if not encoded:
            self._live()  # closed is closed, even for nothing to write
            return []
        return list(
            await self._write(
                encoded[0].instance_id,
                lambda conn, wake: commit_many_txn(conn, encoded, wake),
                bound=self.busy_timeout,
                nowait=False,
                what="commit_many",
            )
        )

    async def apply_locked(
        self, instance_id: str, request_ids: Sequence[str], plan: Plan, lock: RowLock
    ) -> LockedResult:
        """Under SQLite's database-wide write lock: read, run `plan` on the connection's
        thread, write the entries it returns, commit. Raises LockBusy
        (`lock.nowait`), LockTimeout (after `min(lock.timeout, busy_timeout)`),
        InstanceNotFound, or what `plan` raised."""
        return await self._write(
            instance_id,
            lambda conn, wake: locked_txn(conn, instance_id, request_ids, plan, wake),
            bound=min(lock.timeout, self.busy_timeout),
            nowait=lock.nowait,
            what="apply_locked",
        )

    async def _write(
        self,
        key: str,
        txn: Callable[[sqlite3.Connection, Wake], T],
        *,
        bound: float,
        nowait: bool,
        what: str,
    ) -> T:
        """Run `txn` in a write transaction; once it committed, wake this store's timer
        services if it armed timers, its outbox dispatchers if it wrote messages, and its
        `slot_releases` listeners if it released slots."""
        wake = Wake()
        result = await self._write_txn(key, lambda conn: txn(conn, wake), bound, nowait, what)
        if wake.timers:
            self._wake_timers(min(wake.timers))
        if wake.messages:
            self._wake_outbox()
        if wake.released:
            self._heard(wake.released)
        return result

    async def _write_txn(
        self,
        key: str,
        txn: Callable[[sqlite3.Connection], T],
        bound: float,
        nowait: bool,
        what: str,
    ) -> T:
        pool = self._live()
        started = time.monotonic()
        try:
            await pool.acquire_write(0.0 if nowait else bound)
        except TimeoutError:
            if nowait:
                raise LockBusy(key) from None
            raise LockTimeout(key, time.monotonic() - started) from None
        # One bound covers the wait in this process and the wait on SQLite's busy handler.
        busy_ms = 0 if nowait else millis(bound - (time.monotonic() - started))
        try:
            return await self._submit(
                pool, bounded(busy_ms, self.busy_timeout, immediate, txn), write=True
            )
        except sqlite3.Error as exc:
            if is_busy(exc):
                if nowait:
                    raise LockBusy(key) from exc
                raise LockTimeout(key, time.monotonic() - started) from exc
            raise self._error(exc, what) from exc

    # -- workflow pauses -------------------------------------------------------------------------

    async def pause_workflow(self, workflow: str, reason: str, actor: str | None) -> WorkflowPause:
        """Pause `workflow` (one row); when it is paused already, the pause in place."""
        return await self._write(
            workflow,
            lambda conn, _: pause_workflow_txn(conn, workflow, reason, actor),
            bound=self.busy_timeout,
            nowait=False,
            what="pause_workflow",
        )

    async def resume_workflow(self, workflow: str) -> WorkflowPause | None:
        """Lift the pause of `workflow`; None when it was not paused."""
        return await self._write(
            workflow,
            lambda conn, _: resume_workflow_txn(conn, workflow),
            bound=self.busy_timeout,
            nowait=False,
            what="resume_workflow",
        )

    async def workflow_pauses(self) -> list[WorkflowPause]:
        """Every paused workflow, by name."""
        return await self._read(pauses_txn, what="workflow_pauses")

    # -- plumbing --------------------------------------------------------------------------------

    async def _submit(self, pool: Pool, fn: Callable[[sqlite3.Connection], T], *, write: bool) -> T:
        """Run `fn` on a free connection's thread. With `write`, the caller holds
        `pool.write_lock` and ownership of it passes to this call."""
        try:
            worker = await pool.acquire(self.acquire_timeout, self.path)
        except BaseException:
            if write:
                pool.write_lock.release()
            raise
        loop = asyncio.get_running_loop()

        def release(_: Future[T]) -> None:
            # Released when the thread is done, not when the awaiting task is: if the caller is
            # cancelled mid-transaction, the next writer must not start polling SQLite's busy
            # handler against a transaction of this very store that is still running.
            # RuntimeError: the loop closed under a running transaction; nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(pool.release, worker, write)

        try:
            cfut = worker.executor.submit(fn, worker.conn)
        except BaseException:  # pragma: no cover - guarded by pool.acquire's closed check
            pool.release(worker, write)
            raise
        cfut.add_done_callback(release)
        return await asyncio.wrap_future(cfut)

    def _error(self, exc: sqlite3.Error, what: str) -> StoreError:
        text = str(exc)
        if "no such table" in text:
            hint = (
                "the flowlock schema is missing: run `await store.migrate()` or open the store "
                "with auto_migrate=True"
            )
        elif is_busy(exc):
            hint = (
                f"another connection held the database for longer than busy_timeout="
                f"{self.busy_timeout:.1f} s; retry, or raise busy_timeout"
            )
        elif "readonly" in text or "read-only" in text:
            hint = "the database file (or its directory, for the WAL files) is not writable"
        else:
            hint = "check the database file and retry"
        name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
        return StoreError(
            f"SQLite {what} on {self.path!r} failed ({name}: {text}); the transaction was "
            f"rolled back. {hint[0].upper()}{hint[1:]}"
        )
