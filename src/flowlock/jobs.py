"""Run-once jobs: many processes fire one job for one tick, and it runs once.

A lease keeps other runners out; a fenced row in PostgreSQL decides. See "Run-once
jobs" in docs/deployment.md.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("asyncpg", "postgres", "flowlock.jobs (RunOnce)")

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar

import asyncpg

from flowlock._pg import migrations
from flowlock._pg.errors import Context, wrap_connect
from flowlock._pg.fence import PostgresFenceEpochs
from flowlock._pg.pool import check_pool_size, check_schema, close_pool, connection, create_pool
from flowlock._pg.pooling import resolve, session_needed
from flowlock.core.errors import (
    EngineClosed,
    FlowlockError,
    InvalidInput,
    LockBusy,
    LockLost,
    LockNotOwned,
    LockTimeout,
)
from flowlock.core.lifecycle import AsyncResource
from flowlock.core.settings import (
    DEFAULT_COMMAND_TIMEOUT,
    POSTGRES_SCHEMES,
    PoolingChoice,
    check_application_name,
    check_pooling,
    check_seconds,
    check_text,
    check_url,
)
from flowlock.locks.base import (
    BorrowsFenceEpochs,
    Held,
    Lease,
    LockBackend,
    check_ttl,
    check_wait,
)

__all__ = ["JobContext", "RunOnce", "RunResult", "RunStatus"]

log = logging.getLogger("flowlock")

T = TypeVar("T")

RunStatus = Literal["ran", "took_over", "done_elsewhere", "running_elsewhere"]

# The pool's options are a store's defaults, as when RunOnce borrowed a store's pool. Its
# connections are named "flowlock-runner" in pg_stat_activity unless told otherwise: the bench
# (and perhaps the user's monitoring) looks for it.
_APPLICATION_NAME = "flowlock-runner"
_LOCK_WAIT = 5.0  # seconds any statement waits at most for a row lock, on the server
_LOCK_TIMEOUT = f"{_LOCK_WAIT * 1000:.0f}ms"
_CONNECT_TIMEOUT = 10.0
# Characters of a job, a tick or an owner; the lease key of a job and a tick stays well within
# a lock key's 512.
_MAX_NAME = 200

_ROW = "SELECT state, fencing, owner FROM flowlock_job_runs WHERE job = $1 AND tick = $2"
# $1 job, $2 tick, $3 this runner's fencing token, $4 owner. A new tick is inserted. An existing one
# is claimed only if not done and its owner's token is lower than ours: that owner lost the lease we
# hold. No row back: not ours to run. `prev` reports what was there.
_CLAIM = """
WITH prev AS (
    SELECT state, fencing, owner FROM flowlock_job_runs WHERE job = $1 AND tick = $2
)
INSERT INTO flowlock_job_runs AS r (job, tick, state, fencing, owner)
VALUES ($1, $2, 'running', $3, $4)
ON CONFLICT (job, tick) DO UPDATE
   SET state = 'running', fencing = EXCLUDED.fencing, owner = EXCLUDED.owner,
       attempts = r.attempts + 1, error = NULL, started_at = now(), finished_at = NULL
 WHERE r.state IN ('running', 'failed') AND r.fencing < EXCLUDED.fencing
RETURNING r.attempts, (SELECT state FROM prev) AS prev_state,
          (SELECT fencing FROM prev) AS prev_fencing, (SELECT owner FROM prev) AS prev_owner
"""
# $1 job, $2 tick, $3 this runner's fencing token: only the current owner finishes the tick.
_DONE = """
UPDATE flowlock_job_runs SET state = 'done', finished_at = now()
 WHERE job = $1 AND tick = $2 AND fencing = $3 AND state = 'running'
RETURNING fencing
"""
# $1 job, $2 tick, $3 fencing token, $4 the error.
_FAILED = """
UPDATE flowlock_job_runs SET state = 'failed', finished_at = now(), error = $4
 WHERE job = $1 AND tick = $2 AND fencing = $3 AND state = 'running'
"""


@dataclass(frozen=True, slots=True)
class RunResult(Generic[T]):
    """What one `RunOnce.run` call did.

    `status` is one of:

    - `ran`: this call ran the job.
    - `took_over`: it ran the job after the runner that claimed the tick lost its lease.
    - `done_elsewhere`: the tick was already done.
    - `running_elsewhere`: another runner holds the tick now.

    `fencing` is this call's token when it held the lease. `value` is what `fn`
    returned, when it ran here. `previous_fencing` and `previous_owner` name the runner
    this call took over from, or the one that finished the tick. `attempt` is 1 for a
    first run, more after take-overs and failures.
    """

    job: str
    tick: str
    status: RunStatus
    fencing: int | None = None
    value: T | None = None
    previous_fencing: int | None = None
    previous_owner: str | None = None
    attempt: int = 0

    @property
    def ran(self) -> bool:
        """Whether this call ran the job (`ran` or `took_over`)."""
        return self.status in ("ran", "took_over")

    @property
    def skipped(self) -> bool:
        """Whether this call left the tick to another runner (done, or running there)."""
        return not self.ran


class JobContext:
    """What `fn` gets: the job, the tick and the fencing token.

    Call [`check`][flowlock.jobs.JobContext.check] before anything that must not happen after the
    lease was lost.
    """

    __slots__ = ("_held", "attempt", "job", "tick")

    def __init__(self, job: str, tick: str, held: Held, attempt: int) -> None:
        self.job = job
        self.tick = tick
        self.attempt = attempt
        self._held = held

    @property
    def lease(self) -> Lease:
        """The lease (its deadline moves as the watchdog renews it)."""
        return self._held.lease

    @property
    def fencing(self) -> int:
        """This run's fencing token.

        Pass it to anything outside PostgreSQL that must refuse a runner that was taken over.
        Such a system refuses tokens lower than the highest it has seen.
        """
        return self._held.lease.fencing

    def check(self) -> None:
        """Raise LockLost if the lease was lost (a renewal failed, or its ttl ran out)."""
        self._held.check()


class RunOnce(AsyncResource):
    """Runs each (job, tick) to completion once across every process.

    The processes share `locks` and the PostgreSQL database at `dsn`.

    - `ttl`: the lease, renewed every `ttl / 3` while `fn` runs. A dead runner is taken
      over at most `ttl` later.
    - `wait`: how long to wait for another runner's lease before reporting
      `running_elsewhere` (0: not at all). A waiter that gets the lease after the job
      finished reports `done_elsewhere`.
    - `schema`: where `flowlock_job_runs` lives. It is migrated on open unless
      `auto_migrate=False`.
    - `owner`: this runner's name in the table (default: host, pid and a random suffix).
    - `application_name`: how its connections show in `pg_stat_activity`.
    - `fence_epochs`: the fencing epochs in this database. They are lent on open to a lock
      backend that can borrow them, and taken back on close.
    - `command_timeout`: seconds one round trip may take, beyond the 5 s a statement may
      wait for a row lock. Past it the call raises ConnectionLost, or OutcomeUnknown for a
      claim or completion that may have been written.
    - `pooling`: what sits between this process and PostgreSQL ("auto": found out on open).
      The fencing epochs need a session: behind a transaction pooler (PgBouncer
      `pool_mode=transaction`) `open` refuses with InvalidInput, naming session pooling.
    """

    def __init__(
        self,
        locks: LockBackend,
        dsn: str,
        *,
        schema: str | None = None,
        ttl: float = 30.0,
        wait: float = 0.0,
        pool_size: int = 4,
        acquire_timeout: float = 10.0,
        owner: str | None = None,
        auto_migrate: bool = True,
        application_name: str = _APPLICATION_NAME,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        pooling: PoolingChoice = "auto",
    ) -> None:
        if not isinstance(locks, LockBackend):
            raise InvalidInput(f"locks must be a lock backend, not {type(locks).__name__}")
        check_url("dsn", dsn, POSTGRES_SCHEMES)
        self.ttl = check_ttl(ttl)
        self.wait = check_wait(wait)
        check_application_name(application_name)
        check_schema(schema)
        check_pool_size(pool_size)
        self._acquire_timeout = check_seconds("acquire_timeout", acquire_timeout)
        self._command_timeout = check_seconds("command_timeout", command_timeout)
        self._pooling = check_pooling(pooling)
        if owner is not None:
            check_text("owner", owner, most=_MAX_NAME)
        self.locks = locks
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._dsn = dsn
        self._schema = schema
        self._pool_size = pool_size
        self._auto_migrate = auto_migrate
        self.application_name = application_name
        self._pool: asyncpg.Pool | None = None
        self.fence_epochs = PostgresFenceEpochs(
            self._require_pool, schema=schema, acquire_timeout=acquire_timeout, size=pool_size
        )
        self._give_back_epochs: Callable[[], None] | None = None

    async def open(self) -> None:
        """Connect (and migrate). Idempotent. The lock backend is opened by its owner."""
        if self._pool is not None:
            return
        with wrap_connect(self._dsn):
            pooling = await resolve(
                self._pooling,
                self._dsn,
                application_name=self.application_name,
                connect_timeout=_CONNECT_TIMEOUT,
                command_timeout=self._command_timeout,
            )
            if pooling == "transaction":
                raise session_needed("run-once jobs (RunOnce, with their fencing epochs)")
            self._pool = await create_pool(
                self._dsn,
                max_size=self._pool_size,
                schema=self._schema,
                create_schema=True,
                application_name=self.application_name,
                server_settings={"lock_timeout": _LOCK_TIMEOUT},
                connect_timeout=_CONNECT_TIMEOUT,
                # Every statement here runs on this pool with no timeout= of its own: this is
                # its bound, the lock wait the server allows and command_timeout more.
                command_timeout=_LOCK_WAIT + self._command_timeout,
                pooling=pooling,
            )
        if self._auto_migrate:
            try:
                await migrations.migrate(
                    self._pool,
                    acquire_timeout=self._acquire_timeout,
                    pool_size=self._pool_size,
                    command_timeout=self._command_timeout,
                )
            except BaseException:
                await self.aclose()
                raise
        if isinstance(self.locks, BorrowsFenceEpochs):
            # A Redis backend built without epochs (RedisLocks(url)): with this database's, its
            # tokens never repeat across Redis data losses, as a takeover needs.
            self._give_back_epochs = self.locks.borrow_fence_epochs(self.fence_epochs)

    async def aclose(self) -> None:
        """Release the database connections and the lent fencing epochs. Idempotent."""
        give_back, self._give_back_epochs = self._give_back_epochs, None
        if give_back is not None:
            give_back()
        pool, self._pool = self._pool, None
        if pool is not None:
            await close_pool(pool)

    def _require_pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise EngineClosed("the runner is closed; open it first")
        return self._pool

    async def run(
        self, job: str, tick: str | int, fn: Callable[[JobContext], Awaitable[T]]
    ) -> RunResult[T]:
        """Run `fn` for (`job`, `tick`) unless it is done or running elsewhere.

        Raises:

        - LockLost: another runner took the tick over before `fn` finished. `fn`'s result
          is not recorded.
        - Whatever `fn` raises. The tick is left `failed`, and the next `run` runs it again.
        - LockUnavailable or StoreError: the lock backend or the database cannot be reached.
        """
        check_text("job", job, most=_MAX_NAME)
        if isinstance(tick, bool) or not isinstance(tick, str | int):
            raise InvalidInput(f"tick must be a non-empty string or an int, not {tick!r}")
        tick = check_text("tick", str(tick), most=_MAX_NAME)
        # Cheap first: most runners of a tick that already ran stop here, without the lock.
        row = await self._row(job, tick)
        if row is not None and row["state"] == "done":
            return _skipped(job, tick, "done_elsewhere", None, row)
        lease = self.locks.acquire(_key(job, tick), ttl=self.ttl, wait=self.wait)
        try:
            held = await lease.__aenter__()
        except (LockBusy, LockTimeout):
            return RunResult(job, tick, "running_elsewhere")
        try:
            result = await self._claim_and_run(held, job, tick, fn)
        except BaseException as exc:
            await lease.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            await lease.__aexit__(None, None, None)
        except LockNotOwned:
            # The lease ran out just before its release: nothing changes, the outcome was
            # already decided by the fenced write in flowlock_job_runs.
            log.info("flowlock: job %r tick %r: the lease had expired at release", job, tick)
        return result

    async def _claim_and_run(
        self, held: Held, job: str, tick: str, fn: Callable[[JobContext], Awaitable[T]]
    ) -> RunResult[T]:
        fencing = held.lease.fencing
        async with self._conn(writes=True) as conn:
            claim = await conn.fetchrow(_CLAIM, job, tick, fencing, self.owner)
        if claim is None:
            row = await self._row(job, tick)
            if row is not None and row["state"] == "done":
                return _skipped(job, tick, "done_elsewhere", fencing, row)
            # We hold the lease, yet the tick is claimed with a token >= ours: the backend's
            # tokens went backwards (a Redis that lost its data, memory locks shared across
            # processes). Never run twice: leave the tick alone.
            log.warning(
                "flowlock: job %r tick %r is claimed with fencing token %s, not below this "
                "runner's %s, although this runner holds the lease: the lock backend's fencing "
                "tokens went backwards; skipping the tick",
                job,
                tick,
                None if row is None else row["fencing"],
                fencing,
            )
            return _skipped(job, tick, "running_elsewhere", fencing, row)
        took_over = claim["prev_state"] == "running"
        if took_over:
            log.warning(
                "flowlock: job %r tick %r: taking over from %s (fencing token %s), whose lease "
                "was lost",
                job,
                tick,
                claim["prev_owner"],
                claim["prev_fencing"],
            )
        try:
            value = await fn(JobContext(job, tick, held, claim["attempts"]))
        except BaseException as exc:
            await asyncio.shield(self._failed(job, tick, fencing, exc))
            raise
        async with self._conn(writes=True) as conn:
            done = await conn.fetchval(_DONE, job, tick, fencing)
        if done is None:
            row = await self._row(job, tick)
            by = "" if row is None else f" by {row['owner']} (fencing token {row['fencing']})"
            raise LockLost(
                _key(job, tick),
                f"the tick was taken over{by} while this run (fencing token {fencing}) was "
                "still going; its result was not recorded",
            )
        return RunResult(
            job,
            tick,
            "took_over" if took_over else "ran",
            fencing,
            value,
            previous_fencing=claim["prev_fencing"],
            previous_owner=claim["prev_owner"],
            attempt=claim["attempts"],
        )

    async def _failed(self, job: str, tick: str, fencing: int, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        try:
            async with self._conn(writes=True) as conn:
                await conn.execute(_FAILED, job, tick, fencing, error)
        except FlowlockError as failure:
            # The run's own error matters more; the tick stays 'running' and is taken over.
            log.warning(
                "flowlock: job %r tick %r: recording the failure failed: %s", job, tick, failure
            )

    async def _row(self, job: str, tick: str) -> asyncpg.Record | None:
        async with self._conn() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(_ROW, job, tick)
        return row

    @asynccontextmanager
    async def _conn(
        self, *, writes: bool = False
    ) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        """A pooled connection whose driver errors become flowlock errors.

        `writes`: the block runs one autocommit write, so a lost session is OutcomeUnknown.
        """
        if self._pool is None:
            raise EngineClosed("the PostgreSQL store is closed; open it first")
        async with connection(
            self._pool,
            acquire_timeout=self._acquire_timeout,
            size=self._pool_size,
            context=replace(_ERRORS, in_doubt=writes),
        ) as conn:
            yield conn


def _key(job: str, tick: str) -> str:
    return f"flowlock-job:{job}:{tick}"


def _skipped(
    job: str, tick: str, status: RunStatus, fencing: int | None, row: asyncpg.Record | None
) -> RunResult[T]:
    if row is None:
        return RunResult(job, tick, status, fencing)
    return RunResult(
        job, tick, status, fencing, previous_fencing=row["fencing"], previous_owner=row["owner"]
    )


# Every driver error but a missing table is a failure to record the run.
_ERRORS = Context(
    what="recording a job run failed",
    tables="flowlock_job_runs is",
    opener="the runner",
)
