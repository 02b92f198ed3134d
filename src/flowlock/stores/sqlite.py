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
import json
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from flowlock.core.errors import (
    EngineClosed,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockTimeout,
    MigrationError,
    StoreBusy,
    StoreError,
)
from flowlock.core.lifecycle import AsyncResource
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.core.settings import check_count, check_seconds
from flowlock.stores import migrations
from flowlock.stores._batch import distinct_batches, planned_entries, refused_plan
from flowlock.stores.base import (
    Entries,
    LockedResult,
    Plan,
    RequestIds,
    RowLock,
    entries_of,
    request_ids_of,
)

__all__ = ["SqliteStore", "count_statement", "list_statement"]

T = TypeVar("T")
A = TypeVar("A")

_MAX_POOL: Final = 1000
# Request ids per ``IN (...)`` list: below the 999 bound variables of SQLite builds before 3.32.
_IDS_PER_SELECT: Final = 500
_URL_PREFIX: Final = "sqlite:///"
_URL_FORMS: Final = "sqlite:///relative/path.db, sqlite:////absolute/path.db or sqlite:///:memory:"

_INSTANCE_COLUMNS: Final = "id, workflow, state, version, data, last_event, created_at, updated_at"
_HISTORY_COLUMNS: Final = (
    "instance_id, version, event, from_state, to_state, actor, request_id, strategy, data, at, "
    "fencing_token, payload"
)
_SELECT_INSTANCE: Final = f"SELECT {_INSTANCE_COLUMNS} FROM flowlock_instances WHERE id = ?"
_SELECT_PRIOR: Final = (
    f"SELECT {_HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = ? AND request_id = ?"
)
_SELECT_PRIORS: Final = (
    f"SELECT {_HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = ? AND request_id IN "
)
# A fencing token lower than the last one written is refused like a stale version.
_CAS_UPDATE: Final = (
    "UPDATE flowlock_instances SET state = ?, version = ?, data = ?, last_event = ?, "
    "updated_at = ?, fencing_token = coalesce(?, fencing_token) WHERE id = ? AND version = ? "
    "AND (? IS NULL OR coalesce(fencing_token, 0) <= ?)"
)
_INSERT_HISTORY: Final = (
    f"INSERT INTO flowlock_history ({_HISTORY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_MIGRATIONS_TABLE: Final = (
    "CREATE TABLE IF NOT EXISTS flowlock_schema_migrations ("
    "name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)"
)


class SqliteStore(AsyncResource):
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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        auto_migrate: bool = True,
        pool_size: int = 4,
        acquire_timeout: float = 30.0,
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
        # Every connection to ":memory:" (or "", a private temporary file) is its own database.
        self.pool_size = 1 if self.path in (":memory:", "") else pool_size
        self._pool: _Pool | None = None
        self._lifecycle = asyncio.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        busy_timeout: float = 5.0,
        auto_migrate: bool = True,
        pool_size: int = 4,
        acquire_timeout: float = 30.0,
    ) -> SqliteStore:
        """A store for `sqlite:///relative/path.db`, `sqlite:////abs/path.db` or
        `sqlite:///:memory:`. Nothing is opened until
        [`open`][flowlock.stores.sqlite.SqliteStore.open]."""
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
            workers: list[_Worker] = []
            try:
                for _ in range(self.pool_size):
                    workers.append(await self._start_worker())
                pool = _Pool(workers)
                if self.auto_migrate:
                    await self._migrate(pool)
            except BaseException:
                await _stop_workers(workers)
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
            await _stop_workers(pool.workers)

    async def _start_worker(self) -> _Worker:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowlock-sqlite")
        try:
            conn = await asyncio.wrap_future(executor.submit(self._connect))
        except BaseException as exc:
            executor.shutdown(wait=False)
            if isinstance(exc, sqlite3.Error):
                hint = (
                    "another process kept the database locked for longer than busy_timeout; "
                    "retry, or raise busy_timeout"
                    if _is_busy(exc)
                    else "check that the directory exists and is writable by this process"
                )
                raise StoreError(
                    f"could not open the SQLite database {self.path!r}: {exc}; {hint}"
                ) from exc
            raise
        return _Worker(executor, conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {_ms(self.busy_timeout)}")
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
                if not _is_busy(exc) or left <= 0:
                    raise
            time.sleep(min(pause, left))  # on the connection's own thread, not the loop's
            pause = min(2 * pause, 0.05)

    def _live(self) -> _Pool:
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

    async def _migrate(self, pool: _Pool) -> list[str]:
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
        busy_ms = _ms(self.busy_timeout - (time.monotonic() - started))
        try:
            return await self._submit(
                pool, _bounded(busy_ms, self.busy_timeout, _migrate_txn, pending), write=True
            )
        except sqlite3.Error as exc:
            if _is_busy(exc):
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
        """The instance as committed. Raises InstanceNotFound."""
        return await self._read(_get_txn, instance_id, what="get")

    async def read(self, instance_id: str, request_id: RequestIds) -> Snapshot:
        """A consistent read (one snapshot) of the instance and the history entry that carries
        `request_id` (`Snapshot.prior`), or, for a sequence of request ids, the entries found
        for them (`Snapshot.priors`)."""
        return await self._read(_read_txn, instance_id, request_id, what="read")

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        """Every applied transition of the instance, oldest first. Raises InstanceNotFound."""
        return await self._read(_history_txn, instance_id, what="history")

    async def fencing_floor(self, instance_id: str) -> int:
        """The highest fencing token written for the instance (0 if none)."""
        return await self._read(_fence_txn, instance_id, what="fencing_floor")

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        """At most `limit` instances matching `query` with an id after `after`, by id."""
        return await self._read(_list_txn, query, after, limit, what="list")

    async def count_instances(self, query: InstanceQuery) -> int:
        """How many instances match `query`."""
        return await self._read(_count_txn, query, what="count")

    async def _read(self, txn: Callable[..., T], *args: Any, what: str) -> T:
        pool = self._live()
        try:
            return await self._submit(pool, lambda conn: txn(conn, *args), write=False)
        except sqlite3.Error as exc:
            raise self._error(exc, what) from exc

    # -- writes ----------------------------------------------------------------------------------

    async def create(self, instance: Instance) -> Instance:
        """Insert `instance` at version 1, created and updated now. Raises InstanceExists."""
        data = _dump(instance.data, f"data of instance {instance.id!r}")
        return await self._write(
            instance.id,
            lambda conn: _create_txn(conn, instance, data),
            bound=self.busy_timeout,
            nowait=False,
            what="create",
        )

    async def commit(self, entry: Entries) -> Instance | None:
        """Compare-and-swap the instance from the first entry's `version - 1` to the last entry
        and append every entry, in one transaction. None when the version moved, a newer fencing
        token was written or one of the request ids was applied meanwhile (nothing written)."""
        batch = _encode(entries_of(entry))
        return await self._write(
            batch.instance_id,
            lambda conn: _commit_txn(conn, batch),
            bound=self.busy_timeout,
            nowait=False,
            what="commit",
        )

    async def commit_many(self, batches: Sequence[Entries]) -> list[Instance | None]:
        """Every batch's compare-and-swap in one write transaction (SQLite's one round trip):
        one that loses is None at its place and leaves no row, the others commit. Raises
        InstanceNotFound (nothing written) when one of the instances does not exist."""
        encoded = [_encode(batch) for batch in distinct_batches(batches)]
        if not encoded:
            self._live()  # closed is closed, even for nothing to write
            return []
        return await self._write(
            encoded[0].instance_id,
            lambda conn: _commit_many_txn(conn, encoded),
            bound=self.busy_timeout,
            nowait=False,
            what="commit_many",
        )

    async def apply_locked(
        self, instance_id: str, request_id: RequestIds, plan: Plan, lock: RowLock
    ) -> LockedResult:
        """Under SQLite's database-wide write lock: read, run `plan` on the connection's
        thread, write what it returns (one entry or a batch), commit. Raises LockBusy
        (`lock.nowait`), LockTimeout (after `min(lock.timeout, busy_timeout)`),
        InstanceNotFound, or what `plan` raised."""
        return await self._write(
            instance_id,
            lambda conn: _locked_txn(conn, instance_id, request_id, plan),
            bound=min(lock.timeout, self.busy_timeout),
            nowait=lock.nowait,
            what="apply_locked",
        )

    async def _write(
        self,
        key: str,
        txn: Callable[[sqlite3.Connection], T],
        *,
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
        busy_ms = 0 if nowait else _ms(bound - (time.monotonic() - started))
        try:
            return await self._submit(
                pool, _bounded(busy_ms, self.busy_timeout, _immediate, txn), write=True
            )
        except sqlite3.Error as exc:
            if _is_busy(exc):
                if nowait:
                    raise LockBusy(key) from exc
                raise LockTimeout(key, time.monotonic() - started) from exc
            raise self._error(exc, what) from exc

    # -- plumbing --------------------------------------------------------------------------------

    async def _submit(
        self, pool: _Pool, fn: Callable[[sqlite3.Connection], T], *, write: bool
    ) -> T:
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
        elif _is_busy(exc):
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


# -- pool --------------------------------------------------------------------------------------


class _Worker:
    __slots__ = ("conn", "executor")

    def __init__(self, executor: ThreadPoolExecutor, conn: sqlite3.Connection) -> None:
        self.executor = executor
        self.conn = conn


class _Pool:
    """The connections of one open/close cycle, the idle ones, and this store's writer queue."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers
        self.idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        for worker in workers:
            self.idle.put_nowait(worker)
        self.write_lock = asyncio.Lock()
        self.closed = False

    async def acquire_write(self, within: float) -> None:
        """Raises TimeoutError when this store's other writers held on for `within` s."""
        # asyncio.timeout, not wait_for: a free lock is taken without yielding, so a bound of 0
        # still succeeds when nobody holds it (wait_for(..., 0) would always time out).
        async with asyncio.timeout(max(within, 0.0)):
            await self.write_lock.acquire()

    async def acquire(self, within: float, path: str) -> _Worker:
        started = time.monotonic()
        if not self.closed:
            try:
                async with asyncio.timeout(within):
                    worker = await self.idle.get()
            except TimeoutError:
                raise StoreBusy(time.monotonic() - started, len(self.workers)) from None
            if worker is not None and not self.closed:
                return worker
            # Hand the wake-up on, so every task queued for a connection learns of the close.
            self.idle.put_nowait(worker)
        raise EngineClosed(
            f"the SQLite store {path!r} was closed while this operation waited for a connection"
        )

    def release(self, worker: _Worker, write: bool) -> None:
        self.idle.put_nowait(worker)
        if write:
            self.write_lock.release()

    def close(self) -> None:
        self.closed = True
        self.idle.put_nowait(None)


async def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        # Queued behind any transaction still running on that thread, so it finishes first.
        try:
            with contextlib.suppress(sqlite3.Error):  # close() only fails on a misused connection
                await asyncio.wrap_future(worker.executor.submit(worker.conn.close))
        finally:
            worker.executor.shutdown(wait=True)


# -- transactions (each runs entirely on the connection's thread) ------------------------------


def _bounded(
    busy_ms: int,
    default: float,
    txn: Callable[[sqlite3.Connection, A], T],
    arg: A,
) -> Callable[[sqlite3.Connection], T]:
    """`txn` with the connection's busy timeout set to `busy_ms` for its duration only."""
    default_ms = _ms(default)

    def run(conn: sqlite3.Connection) -> T:
        if busy_ms == default_ms:
            return txn(conn, arg)
        conn.execute(f"PRAGMA busy_timeout = {busy_ms}")
        try:
            return txn(conn, arg)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {default_ms}")

    return run


def _immediate(conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
    """`body` in a `BEGIN IMMEDIATE` transaction: committed when it returns, rolled back when
    it raises (including `_Discard`, which makes the transaction return its value)."""
    _begin(conn, "BEGIN IMMEDIATE")
    try:
        result = body(conn)
    except _Discard as discard:
        _rollback(conn)
        value: T = discard.value
        return value
    except BaseException:
        _rollback(conn)
        raise
    try:
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    return result


def _deferred(conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
    # Both selects of a read must see one snapshot; a deferred transaction takes no write lock.
    _begin(conn, "BEGIN DEFERRED")
    try:
        result = body(conn)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    return result


class _Discard(Exception):
    """Roll the transaction back and return `value` (a lost compare-and-swap, or a plan that
    asked for no write)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def _begin(conn: sqlite3.Connection, statement: str) -> None:
    if conn.in_transaction:
        # Only after a failed ROLLBACK; a stale transaction would make BEGIN fail forever.
        conn.execute("ROLLBACK")
    conn.execute(statement)


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        # A failure here means SQLite already rolled back (some errors end the transaction
        # themselves); the original exception is the one worth reporting.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _get_txn(conn: sqlite3.Connection, instance_id: str) -> Instance:
    row = conn.execute(_SELECT_INSTANCE, (instance_id,)).fetchone()
    if row is None:
        raise InstanceNotFound(instance_id)
    return _instance(row)


def _snapshot(conn: sqlite3.Connection, instance_id: str, request_id: RequestIds) -> Snapshot:
    instance = _get_txn(conn, instance_id)
    if request_id is None:
        return Snapshot(instance)
    if isinstance(request_id, str):
        row = conn.execute(_SELECT_PRIOR, (instance_id, request_id)).fetchone()
        return Snapshot(instance, None if row is None else _entry(row))
    rows = _rows_of_requests(conn, instance_id, request_ids_of(request_id))
    found = (_entry(row) for row in rows)
    return Snapshot(instance, None, priors={e.request_id: e for e in found if e.request_id})


def _rows_of_requests(
    conn: sqlite3.Connection, instance_id: str, request_ids: Sequence[str]
) -> list[tuple[Any, ...]]:
    """The history rows of `instance_id` that carry one of `request_ids`."""
    rows: list[tuple[Any, ...]] = []
    for at in range(0, len(request_ids), _IDS_PER_SELECT):
        chunk = request_ids[at : at + _IDS_PER_SELECT]
        marks = ", ".join("?" * len(chunk))
        rows += conn.execute(f"{_SELECT_PRIORS}({marks})", (instance_id, *chunk)).fetchall()
    return rows


def _read_txn(conn: sqlite3.Connection, instance_id: str, request_id: RequestIds) -> Snapshot:
    return _deferred(conn, lambda c: _snapshot(c, instance_id, request_id))


def _fence_txn(conn: sqlite3.Connection, instance_id: str) -> int:
    def body(c: sqlite3.Connection) -> int:
        row = c.execute(
            "SELECT coalesce(fencing_token, 0) FROM flowlock_instances WHERE id = ?", (instance_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    return _deferred(conn, body)


def _history_txn(conn: sqlite3.Connection, instance_id: str) -> list[HistoryEntry]:
    def body(c: sqlite3.Connection) -> list[HistoryEntry]:
        if not c.execute(
            "SELECT 1 FROM flowlock_instances WHERE id = ?", (instance_id,)
        ).fetchone():
            raise InstanceNotFound(instance_id)
        rows = c.execute(
            f"SELECT {_HISTORY_COLUMNS} FROM flowlock_history WHERE instance_id = ? "
            "ORDER BY version",
            (instance_id,),
        ).fetchall()
        return [_entry(row) for row in rows]

    return _deferred(conn, body)


def _where(query: InstanceQuery) -> tuple[str, list[Any]]:
    """`query` as a WHERE clause and its arguments. Timestamps are stored as ISO-8601 UTC text
    of one fixed shape (`_ts`), so comparing the text compares the moments."""
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
        args.append(_ts(query.updated_before))
    if query.updated_after is not None:
        clauses.append("updated_at > ?")
        args.append(_ts(query.updated_after))
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
        f"SELECT {_INSTANCE_COLUMNS} FROM flowlock_instances WHERE {where} AND id > ? "
        "ORDER BY id LIMIT ?"
    )
    return sql, [*args, after or "", limit]


def count_statement(query: InstanceQuery) -> tuple[str, list[Any]]:
    """The SELECT of
    [`SqliteStore.count_instances`][flowlock.stores.sqlite.SqliteStore.count_instances] and its
    arguments."""
    where, args = _where(query)
    return f"SELECT count(*) FROM flowlock_instances WHERE {where}", args


def _list_txn(
    conn: sqlite3.Connection, query: InstanceQuery, after: str | None, limit: int
) -> list[Instance]:
    sql, args = list_statement(query, after=after, limit=limit)
    return [_instance(row) for row in conn.execute(sql, args).fetchall()]


def _count_txn(conn: sqlite3.Connection, query: InstanceQuery) -> int:
    sql, args = count_statement(query)
    [(count,)] = conn.execute(sql, args).fetchall()
    return int(count)


def _create_txn(conn: sqlite3.Connection, instance: Instance, data: str) -> Instance:
    now = _now()
    cur = conn.execute(
        f"INSERT INTO flowlock_instances ({_INSTANCE_COLUMNS}) VALUES (?, ?, ?, 1, ?, ?, ?, ?) "
        "ON CONFLICT (id) DO NOTHING",
        (instance.id, instance.workflow, instance.state, data, instance.last_event, now, now),
    )
    if cur.rowcount == 0:
        raise InstanceExists(instance.id)
    return _get_txn(conn, instance.id)


@dataclass(frozen=True, slots=True)
class _Batch:
    """One instance's checked batch with its JSON encoded before the transaction starts, so data
    that cannot be stored raises InvalidInput before anything is written."""

    entries: tuple[HistoryEntry, ...]
    data: tuple[str, ...]
    payloads: tuple[str, ...]

    @property
    def instance_id(self) -> str:
        return self.entries[0].instance_id


def _encode(batch: tuple[HistoryEntry, ...]) -> _Batch:
    iid = batch[0].instance_id
    return _Batch(
        batch,
        tuple(_dump(e.data, f"data of the history entry for {iid!r}") for e in batch),
        tuple(_dump(e.payload, f"payload of the history entry for {iid!r}") for e in batch),
    )


def _write_batch(conn: sqlite3.Connection, batch: _Batch) -> Instance | None:
    """The compare-and-swap of one instance's batch and its history rows; None when it lost,
    and then it wrote nothing (every check comes before the first write: this transaction holds
    the database's write lock, so nothing changes between them)."""
    first, last = batch.entries[0], batch.entries[-1]
    request_ids = [e.request_id for e in batch.entries if e.request_id is not None]
    if request_ids and _rows_of_requests(conn, first.instance_id, request_ids):
        return None  # already applied (so the instance exists)
    now = _now()
    cur = conn.execute(
        _CAS_UPDATE,
        (
            last.to_state,
            last.version,
            batch.data[-1],
            last.event,
            now,
            last.fencing_token,
            first.instance_id,
            first.version - 1,
            last.fencing_token,
            last.fencing_token,
        ),
    )
    if cur.rowcount == 0:
        _get_txn(conn, first.instance_id)  # InstanceNotFound rather than a silent conflict
        return None
    conn.executemany(
        _INSERT_HISTORY,
        [
            (
                e.instance_id,
                e.version,
                e.event,
                e.from_state,
                e.to_state,
                e.actor,
                e.request_id,
                e.strategy,
                data,
                now,
                e.fencing_token,
                payload,
            )
            for e, data, payload in zip(batch.entries, batch.data, batch.payloads, strict=True)
        ],
    )
    return _get_txn(conn, first.instance_id)


def _commit_txn(conn: sqlite3.Connection, batch: _Batch) -> Instance | None:
    committed = _write_batch(conn, batch)
    if committed is None:
        raise _Discard(None)  # a lost compare-and-swap writes nothing
    return committed


def _commit_many_txn(conn: sqlite3.Connection, batches: list[_Batch]) -> list[Instance | None]:
    # A lost compare-and-swap writes nothing before it returns None (see _write_batch), so the
    # winners commit with it; an error rolls the whole transaction back.
    return [_write_batch(conn, batch) for batch in batches]


def _locked_txn(
    conn: sqlite3.Connection, instance_id: str, request_id: RequestIds, plan: Plan
) -> LockedResult:
    snapshot = _snapshot(conn, instance_id, request_id)
    planned = planned_entries(instance_id, plan(snapshot))
    if not planned:
        raise _Discard(LockedResult(snapshot, None))
    committed = _write_batch(conn, _encode(planned))
    if committed is None:
        raise refused_plan(instance_id, planned, snapshot)
    return LockedResult(snapshot, committed)


def _migrate_txn(conn: sqlite3.Connection, pending: list[migrations.Migration]) -> list[str]:
    def body(c: sqlite3.Connection) -> list[str]:
        c.execute(_MIGRATIONS_TABLE)
        done = {row[0] for row in c.execute("SELECT name FROM flowlock_schema_migrations")}
        applied: list[str] = []
        for migration in pending:
            if migration.name in done:
                continue
            for statement in _statements(migration.sql):
                c.execute(statement)
            c.execute(
                "INSERT INTO flowlock_schema_migrations (name, applied_at) VALUES (?, ?)",
                (migration.name, _now()),
            )
            applied.append(migration.name)
        return applied

    return _immediate(conn, body)


def _statements(script: str) -> list[str]:
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


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def _now() -> str:
    return _ts(datetime.now(UTC))


def _ts(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def _parse_ts(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def _dump(data: Mapping[str, Any], what: str) -> str:
    try:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(
            f"{what} cannot be stored as JSON ({exc}); use only dicts, lists, strings, finite "
            "numbers, booleans and None"
        ) from exc


def _load(text: str, where: str) -> dict[str, Any]:
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


def _instance(row: tuple[Any, ...]) -> Instance:
    return Instance(
        id=row[0],
        workflow=row[1],
        state=row[2],
        version=row[3],
        data=_load(row[4], f"instance {row[0]!r}"),
        last_event=row[5],
        created_at=_parse_ts(row[6]),
        updated_at=_parse_ts(row[7]),
    )


def _entry(row: tuple[Any, ...]) -> HistoryEntry:
    return HistoryEntry(
        instance_id=row[0],
        version=row[1],
        event=row[2],
        from_state=row[3],
        to_state=row[4],
        actor=row[5],
        request_id=row[6],
        strategy=row[7],
        data=_load(row[8], f"history entry {row[0]!r} v{row[1]}"),
        at=_parse_ts(row[9]),
        fencing_token=row[10],
        payload=_load(row[11], f"payload of history entry {row[0]!r} v{row[1]}"),
    )


def _is_busy(exc: sqlite3.Error) -> bool:
    # The primary result code is the low byte; BUSY_SNAPSHOT, BUSY_RECOVERY etc. share it.
    code = getattr(exc, "sqlite_errorcode", None)  # absent on errors raised by the module itself
    if isinstance(code, int) and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return True
    return "database is locked" in str(exc)
