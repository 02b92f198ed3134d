"""The store's statements for one call, run where a `Session` says.

The pessimistic path is one transaction: BEGIN with SET LOCAL lock_timeout, FOR UPDATE, the
request-id lookup, the compare-and-swap, COMMIT.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import asyncpg

from flowlock._pg.errors import Context, in_doubt
from flowlock._pg.rows import entry_from_row, instance_from_row, timer_from_row
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.errors import (
    FlowlockError,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockTimeout,
    StoreError,
)
from flowlock.core.models import (
    Escalation,
    HistoryEntry,
    Instance,
    InstanceQuery,
    Snapshot,
    Timer,
    Timing,
)
from flowlock.stores._batch import planned_entries, refused_plan
from flowlock.stores.base import LockedResult, Plan, RowLock, entries_of
from flowlock.stores.postgres import pipeline
from flowlock.stores.postgres.constraint_sql import create_claim_args
from flowlock.stores.postgres.pipeline import LockedCall, lost_under_lock
from flowlock.stores.postgres.session import (
    Conn,
    DuplicateRequest,
    Session,
    context_of,
    guarded_cas,
    roll_back,
)
from flowlock.stores.postgres.sql import (
    ACTIVE,
    AS_CREATED_BY_ID,
    AS_CREATED_BY_KEY,
    CREATE,
    CREATE_ARMED,
    CREATE_ARMED_CLAIMED,
    CREATE_CLAIMED,
    CREATE_KEY_CONSTRAINT,
    CREATE_KEYED,
    CREATE_KEYED_ARMED,
    CREATE_KEYED_ARMED_CLAIMED,
    CREATE_KEYED_CLAIMED,
    FENCING_FLOOR,
    GET,
    HISTORY,
    LOCK,
    LOCK_NOWAIT,
    NOW,
    PRIOR,
    PRIORS,
    PUBLISH,
    READ,
    READ_ONLY,
    READ_WITH_REQUEST,
    READ_WITH_REQUESTS,
    Batch,
    cas_of,
    count_statement,
    list_statement,
    millis,
    pg_interval,
    priors_in,
    to_json,
)
from flowlock.stores.postgres.timer_sql import (
    CANCEL,
    CLAIM,
    COUNT,
    DROP,
    DUE,
    NEXT_DUE,
    RELEASE,
    TIMERS,
    create_arm_args,
)

# The creates by (armed, keyed): plain, arming timers, under a key, both; then applying claims.
_CREATES = (CREATE, CREATE_ARMED, CREATE_KEYED, CREATE_KEYED_ARMED)
_CLAIMED_CREATES = (
    CREATE_CLAIMED,
    CREATE_ARMED_CLAIMED,
    CREATE_KEYED_CLAIMED,
    CREATE_KEYED_ARMED_CLAIMED,
)


class Operations:
    """The store's statements, run where `session` says."""

    def __init__(self, session: Session) -> None:
        self._s = session

    @property
    def session(self) -> Session:
        """Where these statements run (for the statements of other modules: the outbox's)."""
        return self._s

    async def create(
        self,
        instance: Instance,
        request_id: str | None = None,
        arm: Sequence[Timing] = (),
        claims: Sequence[Claim] = (),
    ) -> Instance:
        key, started, timeout = instance.id, time.monotonic(), self._s.timeout
        args = (
            instance.id,
            instance.workflow,
            instance.state,
            to_json(instance.data),
            instance.definition_version,
        )
        # The initial state's timers, armed by the same statement (stay 1), and its claims.
        armed = create_arm_args(arm) if arm else ()
        if claims:
            armed = (*armed, *create_claim_args(instance, claims))
        # An insert of the same id (or key) by a transaction still open waits for it
        # (lock_timeout).
        async with self._s.conn(
            key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
        ) as conn:
            statements = _CLAIMED_CREATES if claims else _CREATES
            if request_id is None:
                sql = self._s.sql(statements[bool(arm)])
                if claims and self._s.callers:
                    # A refused claim must undo this statement only, in a caller's transaction.
                    row = await guarded_cas(conn, sql, (*args, *armed), timeout)
                else:
                    row = await conn.fetchrow(sql, *args, *armed, timeout=timeout)
            else:
                keyed = statements[2 + bool(arm)]
                row = await self._create_keyed(conn, keyed, (*args, request_id, *armed))
                if row is None:
                    # The id is taken or the key recorded: by this key's first create (a retry,
                    # or a concurrent twin that committed while this one waited), or not.
                    found = await conn.fetchrow(
                        self._s.sql(AS_CREATED_BY_KEY), request_id, timeout=timeout
                    )
                    if found is not None:
                        return instance_from_row(found)
        if row is None:
            raise InstanceExists(instance.id)
        return instance_from_row(row)

    async def _create_keyed(
        self, conn: Conn, statement: str, args: tuple[Any, ...]
    ) -> asyncpg.Record | None:
        """CREATE_KEYED (or its armed twin); None when it inserted nothing (the id taken, or
        the key recorded)."""
        timeout, sql = self._s.timeout, self._s.sql(statement)
        try:
            if self._s.joined:
                # In a transaction flowlock does not end, a recorded key must undo this
                # statement only, leaving the transaction usable for the lookup.
                return await guarded_cas(conn, sql, args, timeout)
            return await conn.fetchrow(sql, *args, timeout=timeout)
        except asyncpg.UniqueViolationError as exc:
            if getattr(exc, "constraint_name", None) != CREATE_KEY_CONSTRAINT:
                raise
            return None

    async def create_request(self, instance_id: str) -> tuple[str, Instance] | None:
        async with self._s.conn(instance_id) as conn:
            row = await conn.fetchrow(
                self._s.sql(AS_CREATED_BY_ID), instance_id, timeout=self._s.timeout
            )
        return None if row is None else (row["request_id"], instance_from_row(row))

    async def get(self, instance_id: str) -> Instance:
        async with self._s.conn(instance_id) as conn:
            row = await conn.fetchrow(self._s.sql(GET), instance_id, timeout=self._s.timeout)
        if row is None:
            raise InstanceNotFound(instance_id)
        inst = instance_from_row(row)
        if row["t_instance_id"] is None:
            return inst
        return inst.evolve(next_timer=timer_from_row(row, "t_"))

    async def read(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        ids, timeout, sql = tuple(dict.fromkeys(request_ids)), self._s.timeout, self._s.sql
        async with self._s.conn(instance_id) as conn:
            # Why three statements: the one-id read is the hot path, one row at most.
            if len(ids) > 1:
                rows = await conn.fetch(
                    sql(READ_WITH_REQUESTS), instance_id, list(ids), timeout=timeout
                )
            elif ids:
                row = await conn.fetchrow(
                    sql(READ_WITH_REQUEST), instance_id, ids[0], timeout=timeout
                )
                rows = [] if row is None else [row]
            else:
                row = await conn.fetchrow(sql(READ), instance_id, timeout=timeout)
                rows = [] if row is None else [row]
        if not rows:
            raise InstanceNotFound(instance_id)
        return Snapshot(instance_from_row(rows[0]), priors_in(rows) if ids else {})

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        return await self.commit_batch(entries_of(entries))

    async def commit_batch(self, batch: Batch) -> Instance | None:
        """`commit` of a batch [`entries_of`][flowlock.stores.base.entries_of] has checked."""
        key = batch[0].instance_id
        started = time.monotonic()
        (text, args), timeout = cas_of(batch), self._s.timeout
        sql = self._s.sql(text)
        # In the caller's transaction a duplicate request id must undo this statement only. In
        # a transaction of flowlock's own around this one call, the failed statement aborts it
        # and its COMMIT rolls back: nothing else was in it, so no savepoint is needed.
        # A refused claim too.
        guarded = self._s.callers and any(e.request_id is not None or e.claims for e in batch)
        try:
            async with self._s.conn(
                key, busy=lambda _: LockTimeout(key, time.monotonic() - started), writes=True
            ) as conn:
                row = await (
                    guarded_cas(conn, sql, args, timeout)
                    if guarded
                    else conn.fetchrow(sql, *args, timeout=timeout)
                )
        except DuplicateRequest:
            # The same request id was applied by a concurrent caller; the statement rolled back
            # whole. Report a lost race: the next read finds that entry and answers idempotently.
            return None
        return None if row is None else instance_from_row(row)

    async def read_together(
        self, calls: Sequence[tuple[str, str | None]]
    ) -> list[Snapshot | FlowlockError]:
        return await pipeline.read_together(self._s, calls)

    async def commit_together(self, batches: Sequence[Batch]) -> list[Instance | None]:
        return await pipeline.commit_together(self._s, batches)

    async def apply_locked(
        self, instance_id: str, request_ids: Sequence[str], plan: Plan, lock: RowLock
    ) -> LockedResult:
        started = time.monotonic()
        wanted = pg_interval(lock.timeout)
        # Any statement of this transaction may wait the strategy's lock.timeout on the server
        # (which may differ from the store's lock_timeout): the client waits that and more.
        bound = max(self._s.timeout, lock.timeout + self._s.command_timeout)

        def busy(_: BaseException) -> FlowlockError:
            if lock.nowait:
                return LockBusy(instance_id)
            return LockTimeout(instance_id, time.monotonic() - started)

        async with self._s.conn(instance_id, busy=busy) as conn:
            if self._s.joined:
                # Inside a transaction someone else ends: set the bound for the rest of it (the
                # caller's own setting is put back by in_transaction), lock, step, write; the
                # row lock is held until that transaction ends.
                if not lock.nowait:
                    await conn.execute(f"SET LOCAL lock_timeout = '{wanted}'", timeout=bound)
                snap, committed, locked_at = await _locked_step(
                    conn, self._s, instance_id, request_ids, plan, lock, wanted, bound
                )
            else:
                snap, committed, locked_at = await _own_transaction(
                    conn,
                    self._s,
                    instance_id,
                    request_ids,
                    plan,
                    lock,
                    wanted,
                    context_of(instance_id, busy),
                    bound,
                )
            released_at = time.monotonic()
        return LockedResult(snap, committed, locked_at - started, released_at - locked_at)

    async def apply_locked_together(
        self, calls: Sequence[LockedCall]
    ) -> list[LockedResult | BaseException | None]:
        return await pipeline.apply_locked_together(self._s, calls)

    async def publish(self, escalation: Escalation) -> None:
        async with self._s.conn(escalation.key, writes=True) as conn:
            await conn.execute(self._s.sql(PUBLISH), escalation.key, escalation.strategy,
                               escalation.until, escalation.reason,
                               timeout=self._s.timeout)  # fmt: skip

    async def active(self, now: float) -> list[Escalation]:
        async with self._s.conn() as conn:
            rows = await conn.fetch(self._s.sql(ACTIVE), now, timeout=self._s.timeout)
        return [Escalation(r["key"], r["strategy"], r["until"], r["reason"]) for r in rows]

    async def now(self) -> float:
        async with self._s.conn() as conn:
            return float(await conn.fetchval(NOW, timeout=self._s.timeout))

    async def fencing_floor(self, instance_id: str) -> int:
        async with self._s.conn(instance_id) as conn:
            token = await conn.fetchval(
                self._s.sql(FENCING_FLOOR), instance_id, timeout=self._s.timeout
            )
        return int(token or 0)

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        sql, args = list_statement(query, after=after, limit=limit)
        async with self._s.conn() as conn:
            rows = await conn.fetch(self._s.sql(sql), *args, timeout=self._s.timeout)
        return [instance_from_row(r) for r in rows]

    async def ping(self) -> None:
        async with self._s.conn() as conn:
            read_only = await conn.fetchval(READ_ONLY, timeout=self._s.timeout)
        if read_only:
            raise StoreError(
                "PostgreSQL answers but is read-only (a standby, or default_transaction_read_only "
                "on): every write would fail. Point the URL at the primary (a multi-host URL with "
                "target_session_attrs=read-write follows it)"
            )

    async def count_instances(self, query: InstanceQuery) -> int:
        sql, args = count_statement(query)
        async with self._s.conn() as conn:
            count = await conn.fetchval(self._s.sql(sql), *args, timeout=self._s.timeout)
        return int(count)

    # -- timers (flowlock.stores.base.TimerStore) -----------------------------------------------

    async def claim_timers(
        self, workflows: Sequence[str], limit: int, lease: float, owner: str
    ) -> list[Timer]:
        async with self._s.conn(writes=True) as conn:
            rows = await conn.fetch(
                self._s.sql(CLAIM), list(workflows), limit, lease, owner, timeout=self._s.timeout
            )
        return [timer_from_row(r) for r in rows]

    async def release_timer(self, timer: Timer, owner: str) -> None:
        async with self._s.conn(timer.instance_id, writes=True) as conn:
            await conn.execute(self._s.sql(RELEASE), *_timer_key(timer), owner,
                               timeout=self._s.timeout)  # fmt: skip

    async def cancel_timer(self, timer: Timer) -> bool:
        async with self._s.conn(timer.instance_id, writes=True) as conn:
            done = await conn.fetchval(
                self._s.sql(CANCEL), *_timer_key(timer), timeout=self._s.timeout
            )
        return bool(done)

    async def drop_timer(self, timer: Timer) -> bool:
        async with self._s.conn(timer.instance_id, writes=True) as conn:
            done = await conn.execute(
                self._s.sql(DROP), *_timer_key(timer), timeout=self._s.timeout
            )
        return done == "DELETE 1"

    async def next_due(self, workflows: Sequence[str]) -> float | None:
        async with self._s.conn() as conn:
            seconds = await conn.fetchval(
                self._s.sql(NEXT_DUE), list(workflows), timeout=self._s.timeout
            )
        return None if seconds is None else max(0.0, float(seconds))

    async def timers(self, instance_id: str) -> list[Timer]:
        async with self._s.conn(instance_id) as conn:
            rows = await conn.fetch(self._s.sql(TIMERS), instance_id, timeout=self._s.timeout)
        return [timer_from_row(r) for r in rows]

    async def due_timers(self, within: float, limit: int) -> list[Timer]:
        async with self._s.conn() as conn:
            rows = await conn.fetch(self._s.sql(DUE), within, limit, timeout=self._s.timeout)
        return [timer_from_row(r) for r in rows]

    async def count_timers(self) -> int:
        async with self._s.conn() as conn:
            return int(await conn.fetchval(self._s.sql(COUNT), timeout=self._s.timeout))

    async def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        async with self._s.conn(instance_id) as conn:
            rows = await conn.fetch(
                self._s.sql(HISTORY), instance_id, after, limit, timeout=self._s.timeout
            )
            found = rows or await conn.fetchrow(
                self._s.sql(READ), instance_id, timeout=self._s.timeout
            )
            if found is None:
                raise InstanceNotFound(instance_id)
        return [entry_from_row(r) for r in rows]


class CallerTransaction(Operations):
    """The store inside a caller's open transaction (a
    [`flowlock.stores.base.Store`][flowlock.stores.base.Store] for the strategies). It opens,
    closes, commits and migrates nothing: the caller owns the connection and its transaction."""

    async def open(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def migrate(self) -> list[str]:
        raise InvalidInput("migrate through the engine's store, not inside a caller's transaction")

    async def commit_many(
        self, batches: Sequence[Sequence[HistoryEntry]]
    ) -> list[Instance | ConstraintRefused | None]:
        # One by one, each in its savepoint when it carries request ids or claims: in a
        # transaction flowlock does not end, a failed statement must undo that batch only, and
        # the caller already holds whatever rows it locked in whatever order.
        done: list[Instance | ConstraintRefused | None] = []
        for batch in batches_of(batches):
            try:
                done.append(await self.commit_batch(batch))
            except ConstraintRefused as exc:
                done.append(exc)
        return done


async def _own_transaction(
    conn: Conn,
    s: Session,
    instance_id: str,
    request_ids: Sequence[str],
    plan: Plan,
    lock: RowLock,
    wanted: str,
    context: Context,
    bound: float,
) -> tuple[Snapshot, Instance | None, float]:
    """The pessimistic path in a transaction of its own on a connection of flowlock's pool;
    `context`: what the driver errors of its COMMIT mean."""
    # Why BEGIN and SET LOCAL in one simple-protocol round trip: the timeout must be in
    # force before the FOR UPDATE, and a separate BEGIN would cost a round trip per call.
    # NOWAIT needs no bound for the row, but the history INSERT may wait behind a concurrent
    # one: the store's lock_timeout (`s.begin` sets it where the session has none).
    await conn.execute(
        s.begin if lock.nowait else f"BEGIN; SET LOCAL lock_timeout = '{wanted}'",
        timeout=bound,
    )
    try:
        done = await _locked_step(conn, s, instance_id, request_ids, plan, lock, wanted, bound)
        # A session lost once COMMIT is on its way may have committed: OutcomeUnknown. So is
        # a COMMIT that outlived its bound: the server may have committed it meanwhile.
        with in_doubt(context):
            await conn.execute("COMMIT", timeout=bound)
    except asyncio.CancelledError:
        # Cancelled mid-statement (waiting for the row lock, say): the connection is
        # busy and cannot take a ROLLBACK. Closing it ends the transaction and frees
        # the lock wait on the server; the pool opens a fresh connection later.
        conn.terminate()
        raise
    except BaseException as exc:
        await roll_back(conn, exc, bound)
        raise
    return done


async def _locked_step(
    conn: Conn,
    s: Session,
    instance_id: str,
    request_ids: Sequence[str],
    plan: Plan,
    lock: RowLock,
    wanted: str,
    bound: float,
) -> tuple[Snapshot, Instance | None, float]:
    if lock.nowait:
        row = await conn.fetchrow(s.sql(LOCK_NOWAIT), instance_id, timeout=bound)
    else:
        row = await conn.fetchrow(s.sql(LOCK), instance_id, timeout=bound)
        if row is not None and millis(row["lock_timeout"]) != millis(wanted):
            raise StoreError(
                f"lock_timeout is {row['lock_timeout']!r} inside the transaction, not "
                f"{wanted!r}; a pooler or a server setting overrode it, refusing to "
                "wait unbounded"
            )
    locked_at = time.monotonic()
    if row is None:
        raise InstanceNotFound(instance_id)
    # The request-id lookup is its own statement, so its snapshot is taken after the lock was
    # granted and sees a duplicate request committed while this call waited.
    ids = tuple(dict.fromkeys(request_ids))
    if len(ids) == 1:
        found = await conn.fetchrow(s.sql(PRIOR), instance_id, ids[0], timeout=bound)
        rows = [] if found is None else [found]
    else:
        rows = await conn.fetch(s.sql(PRIORS), instance_id, list(ids), timeout=bound) if ids else []
    priors = {r["request_id"]: entry_from_row(r) for r in rows}
    snap = Snapshot(instance_from_row(row), priors)
    batch = planned_entries(instance_id, plan(snap))
    if not batch:
        return snap, None, locked_at
    sql, args = cas_of(batch)
    try:
        if s.callers and any(e.claims for e in batch):
            # A refused claim must undo this statement only, in a caller's transaction.
            moved = await guarded_cas(conn, s.sql(sql), args, bound)
        else:
            moved = await conn.fetchrow(s.sql(sql), *args, timeout=bound)
    except asyncpg.UniqueViolationError:
        # A request id the plan should have found applied: the plan's bug, as on every store.
        raise refused_plan(instance_id, batch, snap) from None
    if moved is None:
        raise lost_under_lock(instance_id, batch, snap)
    return snap, instance_from_row(moved), locked_at


def _timer_key(timer: Timer) -> tuple[str, int, str, int]:
    """A timer's row and the firing it is at: the compare-and-swap of a release or cancel."""
    return timer.instance_id, timer.stay, timer.event, timer.n


def batches_of(batches: Sequence[Sequence[HistoryEntry]]) -> tuple[Batch, ...]:
    """`batches` checked before anything is written: each one instance's contiguous batch
    ([`entries_of`][flowlock.stores.base.entries_of]), and no instance in two of them."""
    checked = tuple(entries_of(batch) for batch in batches)
    seen: set[str] = set()
    for batch in checked:
        iid = batch[0].instance_id
        if iid in seen:
            raise InvalidInput(
                f"instance {iid!r} appears in two batches of one commit_many; put its entries "
                "in one batch. Nothing was written"
            )
        seen.add(iid)
    return checked
