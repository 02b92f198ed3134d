"""RedisLocks: the lease protocol, built from the scripts, the wake-ups and the fence.

A caller that finds the key held waits for a release or the holder's expiry, at most
`wait` seconds. A cancelled release still completes. docs/redis-ha.md has the details.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from flowlock.core.errors import (
    EngineClosed,
    InvalidInput,
    LockBusy,
    LockNotOwned,
    LockTimeout,
    LockUnavailable,
)
from flowlock.core.lifecycle import AsyncResource
from flowlock.core.settings import (
    MAX_NAMESPACE,
    check_count,
    check_seconds,
    check_size,
    check_text,
)
from flowlock.locks.base import (
    FenceEpochs,
    Lease,
    LeaseContext,
    check_lock_key,
    check_ttl,
    check_wait,
)
from flowlock.locks.redis import bulk, scripts, urls
from flowlock.locks.redis import many as bulk_api
from flowlock.locks.redis.connection import (
    BACKEND,
    Client,
    Servers,
    bounded,
    close,
    log_late_failure,
    millis,
    servers,
    text,
)
from flowlock.locks.redis.fence import FenceFloors
from flowlock.locks.redis.keys import Keyspace
from flowlock.locks.redis.wakeups import Listener, Wakeups

__all__ = ["RedisLocks"]

log = logging.getLogger("flowlock")

T = TypeVar("T")

# The shortest bound for one call while acquiring, however little of the wait is left: an
# attempt at the deadline still deserves a round trip before it counts as unreachable.
_MIN_CALL = 0.1
# Fencing tokens stay below 2**53 (Lua numbers are doubles, and so are JSON's): a gap above
# this would leave too few epochs above it.
_MAX_FENCE_GAP = 2**40
# How often one acquire starts a counter that then goes missing again before it gives up.
_MAX_STARTS = 3


class RedisLocks(AsyncResource):
    """Lease locks in Redis.

    `url` is `redis://`, `rediss://` or `unix://` for one server,
    `redis+sentinel://` for Sentinel or `redis+cluster://` for a cluster. See
    `urls` for the syntax.

    - `fence_epochs`: a PostgreSQL store's `fence_epochs`; the engine passes it. Keeps
      fencing tokens strictly increasing per key across Redis data losses.
    - `fence_floor(key)`: the highest token recorded outside Redis for `key`. Alone it is
      a weaker guarantee; with epochs it keeps older tokens below.
    - With neither, tokens only increase while Redis keeps its data.
    - `socket_timeout` bounds every call to Redis.
    - `max_connections` caps the connections; callers beyond it queue within their bound.
      In a cluster it is per node, and a burst beyond it raises LockUnavailable.
    - `bulk` (default on): single-key calls that are ready together share one round trip
      (the many-lock scripts, one call per hash slot on a cluster). Off: one call each.
    - `token`, `rng` and `clock` are injectable for tests.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        fence_floor: Callable[[str], Awaitable[int]] | None = None,
        fence_gap: int = 1_000_000,
        fence_epochs: FenceEpochs | None = None,
        socket_timeout: float = 2.0,
        max_connections: int = 100,
        bulk: bool = True,
        token: Callable[[], str] = lambda: secrets.token_hex(16),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        address = urls.parse(url)
        # At least 2: one is the pub/sub listener's.
        check_size("max_connections", max_connections, least=2)
        self._address: urls.RedisAddress | None = address
        self._max_connections = max_connections
        self._init(
            namespace, fence_floor, fence_gap, fence_epochs, socket_timeout, token, rng, clock
        )
        self._bulk = bool(bulk)
        self._servers: Servers | None = None
        self._owns_client = True

    @classmethod
    def from_client(
        cls,
        client: Client,
        *,
        namespace: str = "default",
        fence_floor: Callable[[str], Awaitable[int]] | None = None,
        fence_gap: int = 1_000_000,
        fence_epochs: FenceEpochs | None = None,
        socket_timeout: float = 2.0,
        bulk: bool = True,
        token: Callable[[], str] = lambda: secrets.token_hex(16),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> RedisLocks:
        """Locks on an existing client, which `aclose` leaves open.

        The client is a `redis.asyncio.Redis` (also from a Sentinel's `master_for`) or a
        `RedisCluster`. Its own timeouts and retries apply underneath ours. Turn its retries
        off for exact release semantics. Leave its `socket_timeout` unset: on Python 3.11 the
        write timeout can swallow a cancellation, and every call is bounded here anyway.
        """
        self = cls.__new__(cls)
        self._address = None
        self._max_connections = 0
        self._init(
            namespace, fence_floor, fence_gap, fence_epochs, socket_timeout, token, rng, clock
        )
        self._bulk = bool(bulk)
        self._servers = Servers(client)
        self._owns_client = False
        return self

    def _init(
        self,
        namespace: str,
        fence_floor: Callable[[str], Awaitable[int]] | None,
        fence_gap: int,
        fence_epochs: FenceEpochs | None,
        socket_timeout: float,
        token: Callable[[], str],
        rng: random.Random | None,
        clock: Callable[[], float],
    ) -> None:
        check_text("namespace", namespace, most=MAX_NAMESPACE)
        check_count("fence_gap", fence_gap, least=0, most=_MAX_FENCE_GAP)
        check_seconds("socket_timeout", socket_timeout)
        if fence_epochs is not None and not callable(getattr(fence_epochs, "advance", None)):
            raise InvalidInput(
                "fence_epochs must have an advance() method (a PostgreSQL store's fence_epochs), "
                f"not {fence_epochs!r}"
            )
        self._keys = Keyspace(namespace)
        self._socket_timeout = float(socket_timeout)
        self._token = token
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._open = False
        self._background: set[asyncio.Task[Any]] = set()
        self._fence = FenceFloors(
            fence_floor,
            gap=fence_gap,
            spawn=self._spawn,
            start=self._start_counter,
            namespace=namespace,
            epochs=fence_epochs,
        )
        self._wakeups = Wakeups(self._rng)
        self._listener: Listener | None = None
        self._scripts: scripts.Scripts | None = None
        self._runner: bulk.Runner | None = None
        self._lanes: bulk.Lanes | None = None

    # --- names and state -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return BACKEND

    @property
    def namespace(self) -> str:
        return self._keys.namespace

    @property
    def client(self) -> Client:
        """The redis-py client of an open backend, for tests and diagnostics.

        A `RedisCluster` for a `redis+cluster://` URL, else a `Redis`.
        """
        return self._require_open()

    @property
    def listening(self) -> bool:
        """Whether the pub/sub subscription is live.

        While it is not, waiters still wake at the holder's expiry and at their own bound.
        """
        return self._listener is not None and self._listener.listening

    @property
    def _floors(self) -> Mapping[str, asyncio.Future[int]]:
        """The counter starts in flight, by key (tests check that none is left over)."""
        return self._fence.in_flight

    def redis_key(self, key: str) -> str:
        """The Redis key (and release channel) of lock `key`."""
        return self._keys.lock(key)

    def fence_key(self, key: str) -> str:
        """The Redis key of lock `key`'s fencing counter."""
        return self._keys.fence(key)

    def key_pattern(self) -> str:
        """A SCAN or PSUBSCRIBE pattern for every key and channel of this namespace.

        SCAN walks one server: in a cluster, scan each primary with it.
        """
        return self._keys.pattern()

    # --- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the client and start the pub/sub listener. Idempotent.

        A Redis that is down does not make this fail; acquire raises LockUnavailable until it is
        back. Waits up to `socket_timeout` for the first subscription, so waiters are woken
        from the start.
        """
        if self._open:
            return
        if self._servers is None:
            assert self._address is not None
            self._servers = servers(
                self._address,
                max_connections=self._max_connections,
                connect_timeout=self._socket_timeout,
            )
        self._scripts = scripts.register(self._servers.client)
        self._runner = bulk.Runner(self._servers.client)
        self._lanes = (
            bulk.Lanes(
                self._runner,
                socket_timeout=self._socket_timeout,
                fence=lambda: (self._fence.unknown, self._fence.span),
                forget=self._abandon,
            )
            if self._bulk
            else None
        )
        self._open = True
        self._listener = Listener(
            self._servers.pubsub,
            self.key_pattern(),
            self._wakeups,
            bound=self._socket_timeout,
            rng=self._rng,
        )
        await self._listener.start(
            name=f"flowlock-redis-listen:{self.namespace}", wait=self._socket_timeout + _MIN_CALL
        )

    async def aclose(self) -> None:
        """Stop the listener, let releases in flight finish, and close the client.

        A client from `from_client` stays open. Idempotent; `open()` may be called again.
        """
        if not self._open:
            return
        self._open = False
        self._wakeups.wake_all()  # waiters see the backend closed at once instead of at their bound
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.stop()
        if self._lanes is not None:
            await self._lanes.drain()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._owns_client and self._servers is not None:
            opened, self._servers = self._servers, None
            await close(opened, self._socket_timeout)

    def _require_open(self) -> Client:
        if not self._open or self._servers is None:
            raise EngineClosed(
                "the Redis lock backend is not open; call `await locks.open()` or use "
                "`async with RedisLocks(...)` first"
            )
        return self._servers.client

    # --- the lock --------------------------------------------------------------------------

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        return LeaseContext(self, key, ttl=ttl, wait=wait, clock=self._clock)

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        self._require_open()
        token = self._token()
        started = self._clock()
        deadline = started + wait
        starts = 0
        # Queued before the first attempt and kept until the end; wait=0 never waits. A release
        # published after an attempt was sent wakes the oldest waiter, which retries at once.
        place = self._wakeups.join(self.redis_key(key)) if wait > 0 else None
        lease: Lease | None = None
        try:
            while True:
                self._require_open()
                if place is not None:
                    place.attempting()
                sent = self._clock()
                bound = (
                    self._socket_timeout
                    if wait <= 0
                    else min(self._socket_timeout, max(deadline - sent, _MIN_CALL))
                )
                status, value = await self._attempt(key, token, ttl, bound)
                if status == scripts.ACQUIRED:
                    lease = Lease(key, token, value, ttl, sent + ttl, self.name)
                    return lease
                if status == scripts.NO_COUNTER:
                    starts += 1
                    if starts > _MAX_STARTS:
                        raise LockUnavailable(
                            BACKEND,
                            f"the fencing counter of {key!r} went missing again after each of "
                            f"{_MAX_STARTS} starts: is Redis evicting keys (maxmemory-policy) or "
                            "being flushed?",
                        )
                    bound = max(deadline - self._clock(), self._socket_timeout)
                    await self._fence.floor(key, bound, value)
                    continue
                now = self._clock()
                if place is None:
                    raise LockBusy(key)
                place.held(value)
                left = deadline - now
                if left <= 0:
                    raise LockTimeout(key, now - started)
                if place.woken:
                    continue  # woken while the attempt was in flight: the key may be free now
                # Someone holds the key: their release (or expiry) wakes the oldest waiter.
                await place.wait(left)
        finally:
            if place is not None:
                place.leave(with_lease=lease is not None)

    async def _attempt(self, key: str, token: str, ttl: float, bound: float) -> tuple[int, int]:
        """One run of the acquire script: (status, fencing token or the holder's PTTL)."""
        attempt = bulk.Attempt.of(self._keys, key, token, millis(ttl), bound)
        try:
            if self._lanes is None:
                reply = await self._attempt_one(attempt)
            else:
                reply = await self._lanes.acquire(attempt, self._attempt_one)
        except BaseException:
            # The request may have reached Redis and taken the key for a token nobody will
            # ever release.
            self._abandon(attempt.lock_key, token)
            raise
        return int(reply[0]), int(reply[1])

    async def _attempt_one(self, a: bulk.Attempt) -> Any:
        """The acquire script alone, for one attempt."""
        assert self._scripts is not None
        call = scripts.acquire(
            self._scripts,
            lock_key=a.lock_key,
            fence_key=a.fence_key,
            stamp_key=a.stamp_key,
            token=a.token,
            ttl_ms=a.ttl_ms,
            unknown=self._fence.unknown,
            span=self._fence.span,
        )
        return await bounded("acquire", call, a.bound)

    async def _start_counter(self, key: str, floor: int, bound: float) -> None:
        """Raise `key`'s fencing counter to `floor` (it was missing, or at its epoch's end)."""
        self._require_open()
        assert self._scripts is not None
        call = scripts.start(
            self._scripts,
            fence_key=self.fence_key(key),
            stamp_key=self._keys.stamp(key),
            floor=floor,
            stamp=self._fence.span != "",
        )
        await bounded("start the fencing counter", call, min(bound, self._socket_timeout))

    def borrow_fence_epochs(self, epochs: FenceEpochs) -> Callable[[], None]:
        """Use `epochs` while this backend was given none.

        RunOnce lends its own. Returns the call that gives them back.
        """
        return self._fence.lend(epochs)

    @property
    def fence_epochs(self) -> FenceEpochs | None:
        """The fencing epochs in use: given as `fence_epochs`, else lent, else None."""
        return self._fence.epochs

    async def release(self, lease: Lease) -> None:
        self._check_lease(lease)
        self._require_open()
        # Run to completion even if our caller is cancelled: the token is the lease's, so the
        # late compare-and-delete frees this lease's key or nothing.
        task = self._spawn(self._release(lease))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(log_late_failure)
            raise

    async def _release(self, lease: Lease) -> None:
        hold = bulk.Hold(self.redis_key(lease.key), lease.token)
        if self._lanes is None:
            deleted = await self._release_one(hold)
        else:
            deleted = await self._lanes.release(hold, self._release_one)
        if int(deleted) != 1:
            raise LockNotOwned(lease.key, "release")

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        self._check_lease(lease)
        ttl = lease.ttl if ttl is None else check_ttl(ttl)
        self._require_open()
        sent = self._clock()
        hold = bulk.Hold(self.redis_key(lease.key), lease.token, millis(ttl))
        if self._lanes is None:
            extended = await self._extend_one(hold)
        else:
            extended = await self._lanes.extend(hold, self._extend_one)
        if int(extended) != 1:
            raise LockNotOwned(lease.key, "extend")
        return lease.renewed(sent + ttl, ttl)

    async def _release_one(self, hold: bulk.Hold) -> Any:
        assert self._scripts is not None
        call = scripts.release(self._scripts, lock_key=hold.lock_key, token=hold.token)
        return await bounded("release", call, self._socket_timeout)

    async def _extend_one(self, hold: bulk.Hold) -> Any:
        assert self._scripts is not None
        call = scripts.extend(
            self._scripts, lock_key=hold.lock_key, token=hold.token, ttl_ms=hold.ttl_ms
        )
        return await bounded("extend", call, self._socket_timeout)

    # --- many locks at once (BulkLockBackend) ----------------------------------------------

    async def try_acquire_many(self, keys: Sequence[str], *, ttl: float) -> list[Lease | None]:
        """Try each key once, in one round trip per hash slot group. See BulkLockBackend."""
        return await bulk_api.try_acquire_many(self, keys, ttl)

    async def release_many(self, leases: Sequence[Lease]) -> list[bool]:
        """Release each lease; True where it was still ours. See BulkLockBackend."""
        return await bulk_api.release_many(self, leases)

    async def extend_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """Renew each lease for `ttl`; None where it was lost. See BulkLockBackend."""
        return await bulk_api.extend_many(self, leases, ttl)

    async def ping(self) -> None:
        """One PING within `socket_timeout`, as a readiness probe.

        Raises LockUnavailable when Redis does not answer.
        """
        client = self._require_open()
        await bounded("ping", client.ping(), self._socket_timeout)

    async def wait_released(self, key: str, wait: float) -> bool:
        """Wait, without taking the lock, until `key` is free.

        Returns True once it is seen free, released or expired; False when `wait` seconds pass
        first. Watchers never compete for the lock or take a waiter's wake. Raises
        LockUnavailable when Redis cannot be asked.
        """
        check_lock_key(key)
        check_wait(wait)
        client = self._require_open()
        lock_key = self.redis_key(key)
        deadline = self._clock() + wait
        # Registered before the key is looked at: a release between the look and the wait sets
        # the event, and the wait returns at once.
        with self._wakeups.watch(lock_key) as watch:
            while True:
                self._require_open()
                watch.looking()
                bound = min(self._socket_timeout, max(deadline - self._clock(), _MIN_CALL))
                pttl = int(await bounded("wait_released", client.pttl(lock_key), bound))
                if watch.released or pttl == -2:
                    return True
                left = deadline - self._clock()
                if left <= 0:
                    return False
                # Woken by a release, or at the holder's expiry (then look again: it may have
                # been extended), or by a new subscription (releases may have been missed), or
                # at our own bound.
                expiry = math.inf if pttl < 0 else pttl / 1000 + self._wakeups.jitter()
                woken = await watch.wait(min(left, expiry))
                if watch.released:
                    return True
                if not woken and left <= expiry:
                    return False

    async def owned(self, lease: Lease) -> bool:
        self._check_lease(lease)
        client = self._require_open()
        lock_key = self.redis_key(lease.key)
        value = await bounded("owned", client.get(lock_key), self._socket_timeout)
        return text(value) == lease.token

    async def locked(self, key: str) -> bool:
        check_lock_key(key)
        client = self._require_open()
        lock_key = self.redis_key(key)
        count = await bounded("locked", client.exists(lock_key), self._socket_timeout)
        return int(count) > 0

    # --- helpers ---------------------------------------------------------------------------

    def _check_lease(self, lease: object) -> None:
        if not isinstance(lease, Lease) or lease.backend != self.name:
            raise InvalidInput(f"not a lease taken from a Redis lock backend: {lease!r}")

    def _abandon(self, lock_key: str, token: str) -> None:
        """Free, in the background, what a failed or abandoned acquire may have taken for
        `token` (best effort: it expires at its ttl anyway). The one place that does it: the
        one-key path, the coalesced batches and the many-lock calls all come here. Also while
        closing, as long as the client is there (aclose waits for what was spawned)."""
        if self._servers is not None:
            self._spawn(self._forget(lock_key, token))

    async def _forget(self, lock_key: str, token: str) -> None:
        assert self._scripts is not None
        call = scripts.release(self._scripts, lock_key=lock_key, token=token)
        try:
            await bounded("release", call, self._socket_timeout)
        except LockUnavailable as exc:
            log.debug("flowlock: could not clear an abandoned acquire on %r: %s", lock_key, exc)

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task that aclose() waits for (releases in flight, shared floor fetches...)."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
