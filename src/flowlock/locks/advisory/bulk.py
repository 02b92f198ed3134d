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
from flowlock._pg.errors import wrap_errors
from flowlock._pg.pool import terminate
from flowlock.core.errors import EngineClosed, FlowlockError, LockUnavailable, StoreError
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
    kept: dict[str, Kept] = field(default_factory=dict)
    # When the server's idle timer was last set to run out, less GRACE (inf: switched off).
    timer_at: float = math.inf
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reaper: asyncio.Task[None] | None = None
    busy: int = 0
    dead: bool = False
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class _Try:
    """One single-key try waiting for its batch. `abandoned`: its caller was cancelled, so a
    lease taken for it must be given back."""

    key: str
    lock: int
    ttl: float
    lease: Lease | None = None
    abandoned: bool = False


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
        self._tries: Coalescer[_Try, Lease | None] = Coalescer(
            self._try_batch, depth=holders, max_batch=MAX_BATCH
        )
        self._releases: Coalescer[Lease, bool] = Coalescer(
            self.release_many, depth=holders, max_batch=MAX_BATCH
        )
        self._extends: Coalescer[tuple[Lease, float], Lease | None] = Coalescer(
            self._extend_pairs, depth=holders, max_batch=MAX_BATCH
        )

    def __len__(self) -> int:
        return len(self._kept)

    def kept(self, token: str) -> Kept | None:
        """The bulk lease of `token`, if it is one of this path's."""
        return self._kept.get(token)

    # -- single-key calls, coalesced -------------------------------------------------------

    async def try_one(self, key: str, lock: int, ttl: float) -> Lease | None:
        """One try of `key`, sharing a statement with the tries ready at the same time."""
        call = _Try(key, lock, ttl)
        try:
            return await self._tries.submit(call, self._try_alone)
        except asyncio.CancelledError:
            call.abandoned = True
            if call.lease is not None:
                self._give_back(call.lease)
            raise

    async def _try_alone(self, call: _Try) -> Lease | None:
        [lease] = await self._try_batch([call])
        return lease

    async def release_one(self, lease: Lease) -> bool:
        """Release `lease` (True where it was still ours). Shielded: a cancelled caller still
        frees the key."""
        return await asyncio.shield(self._releases.submit(lease, self._release_alone))

    async def _release_alone(self, lease: Lease) -> bool:
        [done] = await self.release_many([lease])
        return done

    async def extend_one(self, lease: Lease, ttl: float) -> Lease | None:
        """Renew `lease` for `ttl` seconds from now; None where it was lost."""
        return await self._extends.submit((lease, ttl), self._extend_alone)

    async def _extend_alone(self, pair: tuple[Lease, float]) -> Lease | None:
        [renewed] = await self._extend_pairs([pair])
        return renewed

    # -- the BulkLockBackend calls -----------------------------------------------------------

    async def try_acquire_many(
        self, keys: Sequence[str], ttl: float, locks: Sequence[int]
    ) -> list[Lease | None]:
        """Try each key once; a Lease for each taken, None for each held elsewhere."""
        calls = [_Try(key, lock, ttl) for key, lock in zip(keys, locks, strict=True)]
        return await self._try_batch(calls)

    async def release_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Release each lease; True where it was still ours. One statement per holder."""
        done = [False] * len(leases)
        groups: dict[_Holder, list[tuple[int, Kept]]] = {}
        for i, lease in enumerate(leases):
            kept = self._kept.get(lease.token)
            if kept is None or kept.key != lease.key:
                continue
            # Taken off the books before the round trip: a second release is not ours.
            del self._kept[lease.token]
            del kept.holder.kept[lease.token]
            groups.setdefault(kept.holder, []).append((i, kept))
        if groups:
            await asyncio.gather(*(self._free(h, group, done) for h, group in groups.items()))
        return done

    async def _free(self, holder: _Holder, group: list[tuple[int, Kept]], done: list[bool]) -> None:
        sent = self._owner._now()
        freed = await self._run(holder, unlock=[k for _, k in group])
        if freed is None:
            return  # the session ended: the keys went with it, and may be someone else's now
        for i, kept in group:
            # A lease past its deadline was no longer ours to release, even if the reaper had
            # not freed it yet.
            done[i] = kept.deadline > sent

    async def extend_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """Renew each lease for `ttl` seconds from now; None where it was lost."""
        return await self._extend_pairs([(lease, ttl) for lease in leases])

    async def _extend_pairs(self, pairs: Sequence[tuple[Lease, float]]) -> list[Lease | None]:
        renewed: list[Lease | None] = [None] * len(pairs)
        groups: dict[_Holder, list[tuple[int, Kept, float]]] = {}
        for i, (lease, ttl) in enumerate(pairs):
            kept = self._kept.get(lease.token)
            if kept is not None and kept.key == lease.key:
                groups.setdefault(kept.holder, []).append((i, kept, ttl))
        leases = [p[0] for p in pairs]
        if groups:
            await asyncio.gather(
                *(self._renew(h, group, leases, renewed) for h, group in groups.items())
            )
        return renewed

    async def _renew(
        self,
        holder: _Holder,
        group: list[tuple[int, Kept, float]],
        leases: list[Lease],
        renewed: list[Lease | None],
    ) -> None:
        sent = self._owner._now()
        # Any statement restarts the holder's idle timer; this one also counts the new ttls in.
        plan = {id(kept): sent + ttl for _, kept, ttl in group if kept.deadline > sent}
        if await self._run(holder, renew=plan) is None:
            return
        for i, kept, ttl in group:
            deadline = plan.get(id(kept))
            if deadline is not None and self._kept.get(leases[i].token) is kept:
                kept.deadline = max(kept.deadline, deadline)
                renewed[i] = leases[i].renewed(deadline, ttl)
        holder.changed.set()

    # -- tries --------------------------------------------------------------------------------

    async def _try_batch(self, calls: Sequence[_Try]) -> list[Lease | None]:
        # Shielded whole: the statement and the books that follow it must not be split by a
        # caller's cancellation (a key taken on the server and nobody knowing).
        return await asyncio.shield(self._try_inner(calls))

    async def _try_inner(self, calls: Sequence[_Try]) -> list[Lease | None]:
        answers: list[Lease | None] = [None] * len(calls)
        todo: list[int] = []
        for i, call in enumerate(calls):
            if call.lock in self._ids:
                continue  # held (or being taken) by this process: busy, no round trip
            self._ids.add(call.lock)
            todo.append(i)
        if not todo:
            return answers
        try:
            for attempt in (1, 2):
                holder = await self._pick()
                try:
                    taken = await self._take(holder, [calls[i] for i in todo])
                except _HolderGone:
                    # The holder's session ended under it (the server ended it, the network
                    # failed): nothing of the batch is held there. One retry on a fresh one.
                    if attempt == 2 or self._closed:
                        raise LockUnavailable(
                            NAME, f"the holder session ended twice in a row: {holder.error}"
                        ) from holder.error
                    continue
                for i, lease in zip(todo, taken, strict=True):
                    answers[i] = lease
                break
        finally:
            for i in todo:
                if answers[i] is None:
                    self._ids.discard(calls[i].lock)
        for call, lease in zip(calls, answers, strict=True):
            if lease is not None:
                call.lease = lease
                if call.abandoned:
                    self._give_back(lease)
        return answers

    async def _take(self, holder: _Holder, calls: list[_Try]) -> list[Lease | None]:
        sent = self._owner._now()
        tokens = await self._run(holder, tries=calls)
        if tokens is None:
            error = holder.error
            if isinstance(error, FlowlockError) and not isinstance(error, LockUnavailable):
                raise error  # not the session: a retry would fail the same way
            raise _HolderGone
        leases: list[Lease | None] = []
        for call, fence in zip(calls, tokens, strict=True):
            if not fence:
                leases.append(None)
                continue
            token = self._owner._new_token()
            kept = Kept(holder, call.key, call.lock, sent + call.ttl)
            self._kept[token] = holder.kept[token] = kept
            leases.append(Lease(call.key, token, int(fence), call.ttl, sent + call.ttl, NAME))
        holder.changed.set()
        return leases

    # -- holders ------------------------------------------------------------------------------

    async def _pick(self) -> _Holder:
        """The least busy holder; a new one while there are fewer than allowed and all are busy."""
        if self._closed:
            raise EngineClosed("the advisory lock backend is closed; open it first")
        live = [h for h in self._holders if not h.dead]
        idle = [h for h in live if h.busy == 0]
        if idle:
            return idle[0]
        if len(live) < self._most:
            async with self._making:
                live = [h for h in self._holders if not h.dead]
                if len(live) < self._most and not self._closed:
                    holder = await self._open_holder()
                    self._holders.append(holder)
                    return holder
        if not live:
            raise EngineClosed("the advisory lock backend is closed; open it first")
        return min(live, key=lambda h: h.busy)

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
            terminate(conn)
            raise
        holder = _Holder(conn, int(pid))
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
            for kept in freeing:
                self._ids.discard(kept.lock)
            if row is None:
                raise StoreError("the advisory holder statement answered no row")
            tokens: list[int] = list(row["tokens"] or [])
            return tokens

    def _expired(self, holder: _Holder, now: float) -> list[Kept]:
        gone = [(t, k) for t, k in holder.kept.items() if k.deadline <= now]
        for token, _ in gone:
            del holder.kept[token]
            self._kept.pop(token, None)
        return [k for _, k in gone]

    @staticmethod
    def _timer(
        holder: _Holder, sent: float, tries: Sequence[_Try], renew: dict[int, float]
    ) -> float:
        """The earliest deadline the holder will have after this statement (inf: none)."""
        deadlines = [renew.get(id(k), k.deadline) for k in holder.kept.values()]
        deadlines.extend(sent + t.ttl for t in tries)
        return min(deadlines, default=math.inf)

    def _fail(self, holder: _Holder) -> None:
        """End `holder`'s session; its leases are lost (the server frees their keys)."""
        holder.dead = True
        terminate(holder.conn)
        for token, kept in holder.kept.items():
            self._kept.pop(token, None)
            self._ids.discard(kept.lock)
        holder.kept.clear()
        holder.changed.set()
        if holder in self._holders:
            self._holders.remove(holder)

    async def _reap(self, holder: _Holder) -> None:
        """Free each lease's key at its deadline, and restart the server's idle timer before it
        runs out on a holder whose leases are still held."""
        while not holder.dead:
            now = self._owner._now()
            wake = min((k.deadline for k in holder.kept.values()), default=math.inf)
            wake = min(wake, holder.timer_at)
            if wake > now:
                holder.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        holder.changed.wait(), None if math.isinf(wake) else wake - now
                    )
                continue
            try:
                await self._run(holder)
            except FlowlockError:
                return  # _fail has ended the holder; its leases are lost

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


class _HolderGone(Exception):
    """A holder's session ended before its statement was answered."""
