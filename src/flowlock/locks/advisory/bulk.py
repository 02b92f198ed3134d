"""Advisory leases in bulk: many keys held on a few shared sessions, one statement per batch.

A holder is a session of the lease pool that keeps session-level advisory locks for many
leases. One statement on it frees the keys being released, tries the keys being taken, takes
their fencing tokens and resets the server's idle timer. docs/deployment.md says how each lease
keeps its own ttl there: a reaper frees a key when its lease runs out, and the server ends a
holder that goes quiet (the process stalled or died).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import asyncpg

from flowlock._batching import Coalescer
from flowlock._pg.errors import DRIVER_ERRORS, wrap_errors
from flowlock._pg.pool import terminate
from flowlock.core.errors import EngineClosed, FlowlockError, LockUnavailable, StoreError
from flowlock.locks.advisory.deadlines import Deadlines
from flowlock.locks.advisory.errors import ERRORS, NAME
from flowlock.locks.advisory.sql import HOLD, HOLDER_SETUP, ms
from flowlock.locks.base import Lease

__all__ = ["GRACE", "Bulk", "Kept"]

GRACE = 1.0
"""Seconds the server waits past a holder's earliest lease deadline before it ends the quiet
session. The reaper frees an expired key at its deadline; this is its slack."""

# How many batches of one kind run at once (one per holder), and how large a batch may be.
MAX_BATCH = 128


class _Owner(Protocol):
    """What the bulk path needs of its AdvisoryLocks."""

    namespace: str

    def lock_id(self, key: str) -> int: ...

    def _new_token(self) -> str: ...

    def _now(self) -> float: ...

    async def _holder_connection(self) -> asyncpg.pool.PoolConnectionProxy: ...

    def _pools(self) -> tuple[asyncpg.Pool, asyncpg.Pool]: ...


@dataclass(slots=True, eq=False)
class Kept:
    """A lease held on a holder's session, and its deadline on the local clock."""

    holder: _Holder
    key: str
    lock: int
    deadline: float


@dataclass(eq=False)
class _Holder:
    """A shared session and the leases on it. `guard` keeps its statements one at a time."""

    conn: asyncpg.pool.PoolConnectionProxy
    pid: int
    guard: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Single-key calls on this holder (tries, releases, renewals, the reaper's turn): one
    # statement at a time, the next one carrying everything that queued meanwhile.
    ops: Coalescer[_Op, _Answer] | None = None
    kept: dict[str, Kept] = field(default_factory=dict)
    dates: Deadlines[Kept] = field(init=False)  # the deadlines of `kept`, earliest first
    # When the server's idle timer was last set to run out, less GRACE (inf: switched off).
    timer_at: float = math.inf
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reaper: asyncio.Task[None] | None = None
    wake: float = math.inf  # when the reaper wakes next, unless told of an earlier deadline
    busy: int = 0  # statements in flight or waiting for the guard
    queued: int = 0  # single-key calls submitted and not yet answered
    dead: bool = False
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.dates = Deadlines(self.kept)


@dataclass(slots=True, eq=False)
class _Try:
    """One single-key try waiting for its batch. `abandoned`: its caller was cancelled, so a
    lease taken for it must be given back."""

    key: str
    lock: int
    ttl: float
    lease: Lease | None = None
    abandoned: bool = False


@dataclass(slots=True, eq=False)
class _Release:
    lease: Lease


@dataclass(slots=True, eq=False)
class _Renew:
    lease: Lease
    ttl: float


class _Touch:
    """The reaper's turn: free what ran out, restart the server's idle timer."""

    __slots__ = ()


_Op = _Try | _Release | _Renew | _Touch
_Answer = Lease | bool | None


@dataclass(slots=True, eq=False)
class _Plan:
    """One holder statement's work: what it frees, tries and renews, and each op's answer so
    far. `deadlines`: the renewed leases' new deadlines, by id of their Kept."""

    sent: float
    answers: list[_Answer | BaseException]
    freeing: list[tuple[int, Kept]] = field(default_factory=list)
    trying: list[tuple[int, _Try]] = field(default_factory=list)
    renewing: list[tuple[int, _Renew, Kept]] = field(default_factory=list)
    deadlines: dict[int, float] = field(default_factory=dict)
    touch: bool = False

    @property
    def needed(self) -> bool:
        return bool(self.freeing or self.trying or self.renewing or self.touch)


def _lease(answer: object) -> Lease | None:
    if isinstance(answer, BaseException):
        raise answer
    return answer if isinstance(answer, Lease) else None


class Bulk:
    """The bulk path of one AdvisoryLocks: its holders, their reapers and the coalescers that
    put concurrent single-key calls into shared statements."""

    def __init__(self, owner: _Owner, *, holders: int, io_timeout: float) -> None:
        self._owner = owner
        self._most = holders
        self._io_timeout = io_timeout
        self._holders: list[_Holder] = []
        self._making = asyncio.Lock()
        self._kept: dict[str, Kept] = {}
        # Lock ids held or being taken on any holder: a session-level advisory lock is
        # re-entrant, so the server would grant a holder a key it already holds.
        self._ids: set[int] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self.statements = 0
        """Holder statements sent so far (each one round trip): what the tests count."""

    def __len__(self) -> int:
        return len(self._kept)

    def kept(self, token: str) -> Kept | None:
        """The bulk lease of `token`, if it is one of this path's."""
        return self._kept.get(token)

    # -- single-key calls, coalesced -------------------------------------------------------

    async def try_one(self, key: str, lock: int, ttl: float) -> Lease | None:
        """One try of `key`, sharing a statement with what is ready at the same time."""
        call = _Try(key, lock, ttl)
        holder = await self._pick()
        try:
            answer = await self._submit(holder, call)
        except asyncio.CancelledError:
            call.abandoned = True
            if call.lease is not None:
                self._give_back(call.lease)
            raise
        assert answer is None or isinstance(answer, Lease)
        return answer

    async def release_one(self, lease: Lease) -> bool:
        """Release `lease` (True where it was still ours). Shielded: a cancelled caller still
        frees the key."""
        kept = self._kept.get(lease.token)
        if kept is None or kept.key != lease.key:
            return False
        answer = await asyncio.shield(self._submit(kept.holder, _Release(lease)))
        return answer is True

    async def extend_one(self, lease: Lease, ttl: float) -> Lease | None:
        """Renew `lease` for `ttl` seconds from now; None where it was lost."""
        kept = self._kept.get(lease.token)
        if kept is None or kept.key != lease.key:
            return None
        answer = await self._submit(kept.holder, _Renew(lease, ttl))
        assert answer is None or isinstance(answer, Lease)
        return answer

    async def _submit(self, holder: _Holder, op: _Op) -> _Answer:
        if holder.ops is None:
            holder.ops = Coalescer(
                lambda ops: self._mixed(holder, ops), depth=1, max_batch=MAX_BATCH
            )
        holder.queued += 1
        try:
            return await holder.ops.submit(op, lambda one: self._mixed_one(holder, one))
        finally:
            holder.queued -= 1

    async def _mixed_one(self, holder: _Holder, op: _Op) -> _Answer:
        [answer] = await self._mixed(holder, [op])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _mixed(self, holder: _Holder, ops: Sequence[_Op]) -> list[_Answer | BaseException]:
        # Shielded whole: the statement and the books that follow it must not be split by a
        # caller's cancellation (a key taken on the server and nobody knowing).
        return await asyncio.shield(self._mixed_inner(holder, ops))

    async def _mixed_inner(
        self, holder: _Holder, ops: Sequence[_Op], *, retry: bool = True
    ) -> list[_Answer | BaseException]:
        plan = self._plan(holder, ops)
        if not plan.needed:
            return plan.answers  # nothing to ask the server
        tries = [op for _, op in plan.trying]
        unlock = [kept for _, kept in plan.freeing]
        tokens = await self._run(holder, unlock=unlock, tries=tries, renew=plan.deadlines)
        if tokens is None:
            # The session ended: released keys went with it (not ours any more) and renewals
            # are lost; the tries go to another holder once, or get the error.
            for op in tries:
                self._ids.discard(op.lock)
            if tries:
                retried = await self._retry(holder, tries, retry)
                for (i, _), answer in zip(plan.trying, retried, strict=True):
                    plan.answers[i] = answer
            return plan.answers
        answers = plan.answers
        for i, kept in plan.freeing:
            answers[i] = kept.deadline > plan.sent  # past its deadline it was no longer ours
        for i, renew, kept in plan.renewing:
            if self._kept.get(renew.lease.token) is kept:
                deadline = plan.deadlines[id(kept)]
                if deadline > kept.deadline:
                    kept.deadline = deadline
                    holder.dates.add(renew.lease.token, kept)
                answers[i] = renew.lease.renewed(deadline, renew.ttl)
        taken = self._leases(holder, tries, tokens, plan.sent)
        for (i, op), lease in zip(plan.trying, taken, strict=True):
            answers[i] = lease
            if lease is None:
                self._ids.discard(op.lock)
            else:
                self._handed(op, lease)
        return answers

    def _plan(self, holder: _Holder, ops: Sequence[_Op]) -> _Plan:
        """What one statement on `holder` does for `ops`; the books are updated for releases."""
        plan = _Plan(self._owner._now(), [None] * len(ops))
        for i, op in enumerate(ops):
            if isinstance(op, _Release):
                plan.answers[i] = False
                kept = self._mine(holder, op.lease)
                if kept is not None:
                    # Off the books before the round trip: a second release is not ours.
                    del self._kept[op.lease.token], holder.kept[op.lease.token]
                    plan.freeing.append((i, kept))
            elif isinstance(op, _Try):
                if op.lock not in self._ids:  # else held or being taken here: busy
                    self._ids.add(op.lock)
                    plan.trying.append((i, op))
            elif isinstance(op, _Renew):
                kept = self._mine(holder, op.lease)
                if kept is not None and kept.deadline > plan.sent:
                    plan.deadlines[id(kept)] = plan.sent + op.ttl
                    plan.renewing.append((i, op, kept))
            else:
                plan.touch = True
        return plan

    async def _retry(
        self, holder: _Holder, tries: list[_Try], retry: bool
    ) -> Sequence[_Answer | BaseException]:
        error = holder.error
        if isinstance(error, FlowlockError) and not isinstance(error, LockUnavailable):
            return [error] * len(tries)  # not the session: a retry would fail the same way
        if self._closed:
            closed = EngineClosed("the advisory lock backend was closed while acquiring")
            return [closed] * len(tries)
        if not retry or _timed_out(error):
            # A server that did not answer in time would not answer a retry sooner.
            failed = error if isinstance(error, LockUnavailable) else None
            if failed is None:
                failed = LockUnavailable(NAME, f"the holder's session ended: {error}")
            return [failed] * len(tries)
        try:
            other = await self._pick()
        except FlowlockError as exc:
            return [exc] * len(tries)
        return await self._mixed_inner(other, tries, retry=False)

    def _mine(self, holder: _Holder, lease: Lease) -> Kept | None:
        kept = self._kept.get(lease.token)
        if kept is None or kept.key != lease.key or kept.holder is not holder:
            return None
        return kept

    # -- the BulkLockBackend calls -----------------------------------------------------------

    async def try_acquire_many(
        self, keys: Sequence[str], ttl: float, locks: Sequence[int]
    ) -> list[Lease | None]:
        """Try each key once, in one statement; a Lease for each taken, None for each held
        elsewhere."""
        calls = [_Try(key, lock, ttl) for key, lock in zip(keys, locks, strict=True)]
        holder = await self._pick()
        try:
            answers = await self._mixed(holder, calls)
        except asyncio.CancelledError:
            # The statement goes on (shielded): what it takes is given back, not kept to its ttl.
            for call in calls:
                call.abandoned = True
                if call.lease is not None:
                    self._give_back(call.lease)
            raise
        return [_lease(answer) for answer in answers]

    async def release_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Release each lease; True where it was still ours. One statement per holder."""
        answers = await self._per_holder([_Release(lease) for lease in leases])
        return [answer is True for answer in answers]

    async def extend_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """Renew each lease for `ttl` seconds from now; None where it was lost."""
        answers = await self._per_holder([_Renew(lease, ttl) for lease in leases])
        return [None if isinstance(a, BaseException) else _lease(a) for a in answers]

    async def _per_holder(self, ops: Sequence[_Release | _Renew]) -> list[_Answer | BaseException]:
        answers: list[_Answer | BaseException] = [None] * len(ops)
        groups: dict[_Holder, list[int]] = {}
        for i, op in enumerate(ops):
            kept = self._kept.get(op.lease.token)
            if kept is not None:
                groups.setdefault(kept.holder, []).append(i)

        async def one(holder: _Holder, where: list[int]) -> None:
            found = await self._mixed(holder, [ops[i] for i in where])
            for i, answer in zip(where, found, strict=True):
                answers[i] = answer

        await asyncio.gather(*(one(h, where) for h, where in groups.items()))
        return answers

    def _leases(
        self, holder: _Holder, calls: Sequence[_Try], tokens: Sequence[int], sent: float
    ) -> list[Lease | None]:
        """The leases of the tries a statement sent at `sent` answered with `tokens`, on the
        books (0: the key was held elsewhere)."""
        leases: list[Lease | None] = []
        for call, fence in zip(calls, tokens, strict=True):
            if not fence:
                leases.append(None)
                continue
            token = self._owner._new_token()
            kept = Kept(holder, call.key, call.lock, sent + call.ttl)
            self._kept[token] = holder.kept[token] = kept
            holder.dates.add(token, kept)
            leases.append(Lease(call.key, token, int(fence), call.ttl, sent + call.ttl, NAME))
        return leases

    def _handed(self, call: _Try, lease: Lease) -> None:
        """`lease` is `call`'s: its caller's, or given back if the caller has left."""
        call.lease = lease
        if call.abandoned:
            self._give_back(lease)

    # -- holders ------------------------------------------------------------------------------

    async def _pick(self) -> _Holder:
        """The least busy live holder. With none, one is opened first; with all busy and fewer
        than allowed, one more is opened in the background: a busy holder answers in its next
        statement, while a new one may wait for a connection of a full pool."""
        if self._closed:
            raise EngineClosed("the advisory lock backend is closed; open it first")
        live = [h for h in self._holders if not h.dead]
        if not live:
            async with self._making:
                live = [h for h in self._holders if not h.dead]
                if not live:
                    return await self._add_holder()
        best = min(live, key=lambda h: h.busy + h.queued)
        if best.busy + best.queued > 0 and len(live) < self._most and not self._making.locked():
            self._spawn(self._grow())
        return best

    async def _grow(self) -> None:
        async with self._making:
            if sum(not h.dead for h in self._holders) < self._most and not self._closed:
                await self._add_holder()

    async def _add_holder(self) -> _Holder:
        """Open a holder and put it in service (under `_making`)."""
        if self._closed:
            raise EngineClosed("the advisory lock backend is closed; open it first")
        holder = await self._open_holder()
        if self._closed:  # closed while it was opening: end it, as close() ended the others
            if holder.reaper is not None:
                holder.reaper.cancel()
            self._fail(holder)
            raise EngineClosed("the advisory lock backend was closed while acquiring")
        self._holders.append(holder)
        return holder

    async def _open_holder(self) -> _Holder:
        conn = await self._owner._holder_connection()
        try:
            with wrap_errors(ERRORS):
                # lock_timeout bounds the one row lock a holder may wait for: a fencing row
                # behind a stale holder's increment.
                pid = await conn.fetchval(
                    HOLDER_SETUP, f"{ms(self._io_timeout)}", timeout=self._io_timeout
                )
        except BaseException:
            self._end(conn)
            raise
        holder = _Holder(conn, int(pid))
        # A session ended while idle (killed, a restart) is seen at once, not at its next
        # statement: no caller is handed a dead holder, and its connection goes back now.
        conn.add_termination_listener(lambda _: self._fail(holder))
        holder.reaper = asyncio.get_running_loop().create_task(
            self._reap(holder), name="flowlock-advisory-reaper"
        )
        return holder

    async def _run(
        self,
        holder: _Holder,
        *,
        unlock: Sequence[Kept] = (),
        tries: Sequence[_Try] = (),
        renew: dict[int, float] | None = None,
    ) -> list[int] | None:
        """One statement on `holder`, shielded from the caller's cancellation so the books
        always match the server. The fencing tokens of `tries` (0: held elsewhere), or None
        when the session is gone (its keys went with it)."""
        holder.busy += 1
        try:
            return await asyncio.shield(self._statement(holder, unlock, tries, renew or {}))
        finally:
            holder.busy -= 1

    async def _statement(
        self,
        holder: _Holder,
        unlock: Sequence[Kept],
        tries: Sequence[_Try],
        renew: dict[int, float],
    ) -> list[int] | None:
        async with holder.guard:
            if holder.dead:
                for kept in unlock:
                    self._ids.discard(kept.lock)
                return None
            sent = self._owner._now()
            # Leases that ran out go in the same statement: the key is free at its ttl.
            expired = self._expired(holder, sent)
            freeing = [*unlock, *expired]
            timer = self._timer(holder, sent, tries, renew)
            self.statements += 1
            try:
                with wrap_errors(ERRORS):
                    row = await holder.conn.fetchrow(
                        HOLD,
                        [k.lock for k in freeing],
                        [t.lock for t in tries],
                        [t.key for t in tries],
                        self._owner.namespace,
                        str(0 if math.isinf(timer) else ms(timer - sent + GRACE)),
                        timeout=self._io_timeout,
                    )
            except Exception as exc:  # every driver error is a flowlock error by now
                # The session ended, or its state is unknown (a timeout, an error half-way):
                # end it, so that every lock it held is freed, and account its leases lost.
                holder.error = exc
                self._fail(holder)
                for kept in freeing:
                    self._ids.discard(kept.lock)
                return None
            holder.timer_at = timer
            if timer < holder.wake:
                holder.changed.set()  # an earlier deadline than the reaper's next wake
            for kept in freeing:
                self._ids.discard(kept.lock)
            if row is None:
                raise StoreError("the advisory holder statement answered no row")
            tokens: list[int] = list(row["tokens"] or [])
            return tokens

    def _expired(self, holder: _Holder, now: float) -> list[Kept]:
        gone = holder.dates.expired(now)
        for token, _ in gone:
            self._kept.pop(token, None)
        return [k for _, k in gone]

    @staticmethod
    def _timer(
        holder: _Holder, sent: float, tries: Sequence[_Try], renew: dict[int, float]
    ) -> float:
        """The earliest deadline the holder will have after this statement (inf: none)."""
        deadlines = [holder.dates.earliest(skip=renew), *renew.values()]
        deadlines.extend(sent + t.ttl for t in tries)
        return min(deadlines)

    def _fail(self, holder: _Holder) -> None:
        """End `holder`'s session; its leases are lost (the server frees their keys). Once."""
        if holder.dead:
            return
        holder.dead = True
        self._end(holder.conn)
        for token, kept in holder.kept.items():
            self._kept.pop(token, None)
            self._ids.discard(kept.lock)
        holder.kept.clear()
        holder.dates.clear()
        holder.changed.set()
        if holder in self._holders:
            self._holders.remove(holder)

    async def _reap(self, holder: _Holder) -> None:
        """Free each lease's key at its deadline, and restart the server's idle timer before it
        runs out on a holder whose leases are still held."""
        while not holder.dead:
            now = self._owner._now()
            wake = min(holder.dates.earliest(), holder.timer_at)
            holder.wake = wake
            if wake > now:
                holder.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        holder.changed.wait(), None if math.isinf(wake) else wake - now
                    )
                continue
            with contextlib.suppress(FlowlockError):
                await self._submit(holder, _Touch())

    def _end(self, conn: asyncpg.pool.PoolConnectionProxy) -> None:
        """End a holder's session and hand its connection back to the lease pool, which opens
        a fresh one in its place: a terminated connection never given back would count as in
        use for good, and each holder lost (a restart, a killed session) would shrink the pool."""
        terminate(conn)
        if not self._closed:  # closing: the pool is closed next, connections and all
            self._spawn(self._released(conn))

    async def _released(self, conn: asyncpg.pool.PoolConnectionProxy) -> None:
        with contextlib.suppress(EngineClosed, *DRIVER_ERRORS):
            await self._owner._pools()[0].release(conn)

    def _give_back(self, lease: Lease) -> None:
        """Release, in the background, a lease nobody is waiting for any more."""
        self._spawn(self.release_many([lease]))

    def _spawn(self, work: Awaitable[object]) -> None:
        async def run() -> None:
            with contextlib.suppress(FlowlockError):
                await work

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        """End every holder's session (their keys are freed at once) and stop the reapers."""
        self._closed = True
        for holder in list(self._holders):
            if holder.reaper is not None:
                holder.reaper.cancel()
            self._fail(holder)
        for task in list(self._background):
            task.cancel()


def _timed_out(error: BaseException | None) -> bool:
    """Whether `error` comes from a round trip that outlived its timeout."""
    while error is not None:
        if isinstance(error, TimeoutError):
            return True
        error = error.__cause__
    return False
