"""Lease locks in Redis: one key per lock, compare-and-delete / compare-and-extend in Lua,
waiters woken by pub/sub, and fencing tokens that stay increasing across a Redis data loss.

::

    locks = RedisLocks("redis://127.0.0.1:6379/0", namespace="billing")
    await locks.open()
    async with locks.acquire("invoice-42", ttl=10, wait=2) as held:
        ...
        held.check()
    await locks.aclose()

Keys
    Everything lives under ``flowlock:<namespace>:``. The user's key (and the namespace) are
    percent-encoded, so ``:``, ``{``, ``}`` and glob characters never appear raw: ``a:b`` and
    ``a`` + ``:b`` can never meet. The lock of key ``k`` is ``flowlock:<ns>:{<k>}`` and its
    fencing counter ``flowlock:<ns>:{<k>}:fence``; the ``{...}`` hash tag keeps both in one
    Redis Cluster slot, which the acquire script needs. The lock key is also the pub/sub channel
    its release is announced on (channels and keys are separate name spaces in Redis).

Acquiring
    One Lua script does ``SET lock token NX PX ttl`` and ``INCR fence`` atomically, or returns
    the holder's PTTL. The token is 128 random bits (injectable) and belongs to the Lease, never
    to this object. ``Lease.expires_at`` counts from the monotonic time taken before the request
    was sent, so the local deadline never runs past the server's.

Waiting
    One pub/sub connection per backend holds a pattern subscription on the namespace's
    channels; the release script publishes on the lock key's channel. The local waiters of a key
    form a queue in the order they arrived, and a release wakes only the oldest of them, which
    retries at once: one acquire attempt per lease in this process instead of one per waiter.
    (Every other process that waits on the key gets the message too and wakes its own oldest.)
    A waiter joins the queue before its first attempt and stays in it until it is done, so a
    release that lands between an attempt and the wait is not missed: it wakes the oldest
    waiter, and a waiter whose attempt was in flight when woken retries at once. A woken waiter
    that does not end up with the lease (it timed out, was cancelled, gave up on an error) hands
    the wake to the next waiter; one whose retry lost to another process keeps its place at the
    head and waits for that holder's release. A holder that crashes publishes nothing: the
    holder's PTTL (returned by a failed attempt) arms one timer per key, a little after the
    expiry (a random 0-2 ms, so that the processes waiting on the key do not all retry in the
    same millisecond), which wakes the oldest waiter like a release. Every wait ends at ``wait``
    seconds with LockTimeout (``wait=0``: LockBusy at once). There is no sleep loop; new callers
    try once before they queue, so the order is FIFO among the waiters of one process, not
    strict across callers or processes.

Watching
    ``wait_released(key, wait)`` waits for a key to be free without taking it: every watcher of
    the key is woken by its release (they do not compete, and do not take the waiters' wake),
    and by the holder's expiry. The watcher registers before it looks at the key, so a release
    between the look and the wait is not missed.

Fencing and Redis data loss
    The fencing counter is a plain Redis key, so a Redis that restarts empty (no persistence, a
    failover to a replica that had not seen the INCR, an eviction under ``maxmemory``) loses it.
    When the counter is missing the acquire script says so instead of starting again at 1, and
    the client asks ``fence_floor(key)`` (the engine passes a function returning the highest
    fencing token PostgreSQL has recorded for that key; the concurrent acquirers of one key in
    this process share one call) and retries with that floor plus ``fence_gap``; the script
    then does ``SET fence floor NX`` before the INCR. The gap is there because a token can be
    issued and never written anywhere (the holder crashed, or has not committed yet, or is still
    running and will commit): the floor alone would hand the same numbers out again, and a stale
    holder carrying one of them could pass a fencing check.
    Jumping ``fence_gap`` (default one million) past the floor puts new tokens above every token
    issued since the last one that was recorded, as long as fewer than ``fence_gap`` were issued
    in between. Without ``fence_floor``, tokens restart at 1 after a Redis data loss: they are
    then only increasing for as long as Redis keeps its data.

Failures
    Every call to Redis is bounded: by ``socket_timeout``, and while acquiring also by what is
    left of ``wait``. A Redis that refuses, times out or answers an error raises LockUnavailable
    (nothing acquired; at release the key simply expires at its ttl). redis-py's automatic
    retries are off: a retried compare-and-delete whose first try had landed would report
    LockNotOwned for a lease that was in fact released.

Cancellation
    ``release`` runs the compare-and-delete in its own task and shields it, so a cancelled
    release still completes (see redis-py issue 3847) and, carrying the lease's own token, can
    never free another owner's lock. An acquire cancelled (or timed out) while its request was
    in flight may have taken the key without knowing: a best-effort compare-and-delete with its
    token is sent afterwards, and the key expires at its ttl if even that fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from flowlock._lifecycle import AsyncResource
from flowlock.errors import (
    EngineClosed,
    InvalidInput,
    LockBusy,
    LockNotOwned,
    LockTimeout,
    LockUnavailable,
)
from flowlock.locks.base import Lease, LeaseContext, check_lock_args

__all__ = ["RedisLocks"]

log = logging.getLogger("flowlock")

T = TypeVar("T")

# KEYS[1] the lock key, KEYS[2] its fencing counter (same hash slot).
# ARGV[1] the new owner's token, ARGV[2] the ttl in milliseconds,
# ARGV[3] the floor for a missing fencing counter: "" when the client has not fetched one yet.
# Returns {1, fencing token} when acquired; {0, the holder's PTTL in ms (-1: no expiry)} when
# held; {-1, 0} when the counter is missing and no floor was passed (the client fetches the
# floor and calls again). The lock is checked first, so a held lock never costs a floor fetch.
_ACQUIRE = """
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  return {0, pttl}
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  if ARGV[3] == '' then
    return {-1, 0}
  end
  redis.call('SET', KEYS[2], ARGV[3], 'NX')
end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
return {1, redis.call('INCR', KEYS[2])}
"""

# KEYS[1] the lock key (also the channel its release is announced on).
# ARGV[1] the releasing lease's token.
# Returns 1 when the key held that token and was deleted (and waiters told), 0 otherwise: a
# lease that expired never deletes the key of whoever holds it now.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], '')
  return 1
end
return 0
"""

# KEYS[1] the lock key. ARGV[1] the lease's token, ARGV[2] the new ttl in milliseconds.
# Returns 1 when the key held that token and its expiry was reset, 0 otherwise.
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_SCHEMES = ("redis", "rediss", "unix")
# The holder's-expiry timer fires a random delay up to this (seconds) after the PTTL ran out: a
# margin for the server's expiry, and the processes waiting on one key do not all retry in the
# same millisecond. (A waiter woken by a release retries at once: only one per process is.)
_WAKE_JITTER = 0.002
# The shortest bound for one call while acquiring, however little of the wait is left: an
# attempt at the deadline still deserves a round trip before it counts as unreachable.
_MIN_CALL = 0.1
# The pub/sub listener: how often it looks up from a quiet connection, when it PINGs a quiet
# connection to find out it is dead (a half-open TCP connection never errors), and the bounds of
# its reconnect backoff.
_LISTEN_TICK = 1.0
_PING_AFTER = 5.0
_RECONNECT_MIN = 0.05
_RECONNECT_MAX = 2.0


class _Waiter:
    """One acquire waiting in a key's local queue. ``woken``: it was handed a release (or the
    holder's expiry) and has not yet either lost a retry to another holder or taken the lease;
    if it leaves the queue meanwhile, the wake goes to the next waiter."""

    __slots__ = ("event", "woken")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.woken = False


class _Watcher:
    """One ``wait_released`` call. ``released``: a release of the key was announced."""

    __slots__ = ("event", "released")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.released = False


class _Queue:
    """The local waiters (oldest first) and watchers of one lock key, and the timer that wakes
    the oldest waiter when the holder's lease runs out."""

    __slots__ = ("timer", "timer_at", "waiters", "watchers")

    def __init__(self) -> None:
        self.waiters: dict[_Waiter, None] = {}  # insertion-ordered: a FIFO with O(1) removal
        self.watchers: set[_Watcher] = set()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf

    def wake_oldest(self) -> None:
        for waiter in self.waiters:
            waiter.woken = True
            waiter.event.set()
            return

    def announce_release(self) -> None:
        for watcher in self.watchers:
            watcher.released = True
            watcher.event.set()
        self.wake_oldest()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer, self.timer_at = None, math.inf


def _no_maintenance_probe() -> dict[str, Any]:
    # redis-py >= 7 probes every new connection for maintenance notifications ("auto"): one
    # more round trip per connect, answered with an error by servers that lack them.
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # redis-py < 7
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def _escape(part: str) -> str:
    return quote(part, safe="")


def _millis(seconds: float) -> int:
    # Rounded up: the server may keep the key a hair longer than the local deadline, never less.
    return max(1, math.ceil(seconds * 1000))


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)


class RedisLocks(AsyncResource):
    """Lease locks in Redis (see the module docs for the protocol).

    ``url`` is ``redis://``, ``rediss://`` or ``unix://``. ``fence_floor(key)`` returns the
    highest fencing token recorded outside Redis for ``key``; with it, tokens stay increasing
    when Redis loses its data (each loss jumps them by ``fence_gap``). ``socket_timeout`` bounds
    every call to Redis; ``max_connections`` caps the connections (callers beyond it queue for
    one, within their bound). ``token``, ``rng`` and ``clock`` are injectable for tests.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        fence_floor: Callable[[str], Awaitable[int]] | None = None,
        fence_gap: int = 1_000_000,
        socket_timeout: float = 2.0,
        max_connections: int = 100,
        token: Callable[[], str] = lambda: secrets.token_hex(16),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(url, str) or url.partition("://")[0].lower() not in _SCHEMES:
            raise InvalidInput(
                f"the Redis URL must start with redis://, rediss:// or unix://, not {url!r}"
            )
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise InvalidInput(f"max_connections must be an integer, not {max_connections!r}")
        if max_connections < 2:
            raise InvalidInput(
                f"max_connections must be at least 2 (one is the pub/sub listener's), "
                f"not {max_connections}"
            )
        self._url: str | None = url
        self._max_connections = max_connections
        self._init(namespace, fence_floor, fence_gap, socket_timeout, token, rng, clock)
        self._client: aioredis.Redis | None = None
        self._owns_client = True

    @classmethod
    def from_client(
        cls,
        client: aioredis.Redis,
        *,
        namespace: str = "default",
        fence_floor: Callable[[str], Awaitable[int]] | None = None,
        fence_gap: int = 1_000_000,
        socket_timeout: float = 2.0,
        token: Callable[[], str] = lambda: secrets.token_hex(16),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> RedisLocks:
        """Locks on an existing client, which ``aclose`` leaves open. Its own timeouts and
        retries apply underneath ours: turn its retries off for exact release semantics, and
        leave its ``socket_timeout`` unset (on Python 3.11 redis-py's write timeout can swallow
        a task cancellation; every call is bounded here anyway)."""
        self = cls.__new__(cls)
        self._url = None
        self._max_connections = 0
        self._init(namespace, fence_floor, fence_gap, socket_timeout, token, rng, clock)
        self._client = client
        self._owns_client = False
        return self

    def _init(
        self,
        namespace: str,
        fence_floor: Callable[[str], Awaitable[int]] | None,
        fence_gap: int,
        socket_timeout: float,
        token: Callable[[], str],
        rng: random.Random | None,
        clock: Callable[[], float],
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise InvalidInput(f"namespace must be a non-empty string, not {namespace!r}")
        if isinstance(fence_gap, bool) or not isinstance(fence_gap, int) or fence_gap < 0:
            raise InvalidInput(f"fence_gap must be a non-negative integer, not {fence_gap!r}")
        if (
            isinstance(socket_timeout, bool)
            or not isinstance(socket_timeout, int | float)
            or not 0 < socket_timeout < math.inf
        ):
            raise InvalidInput(f"socket_timeout must be a positive number, not {socket_timeout!r}")
        self._namespace = namespace
        self._prefix = f"flowlock:{_escape(namespace)}:"
        self._fence_floor = fence_floor
        self._fence_gap = fence_gap
        self._socket_timeout = float(socket_timeout)
        self._token = token
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._open = False
        self._listener: asyncio.Task[None] | None = None
        self._listening = False
        self._queues: dict[str, _Queue] = {}  # by lock key (= release channel)
        self._floors: dict[str, asyncio.Task[int]] = {}  # fence_floor calls in flight, by key
        self._background: set[asyncio.Task[Any]] = set()
        self._scripts: tuple[Any, Any, Any] | None = None

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "redis"

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def client(self) -> aioredis.Redis:
        """The redis-py client (open backends only); for tests and diagnostics."""
        return self._require_open()

    @property
    def listening(self) -> bool:
        """Whether the pub/sub subscription is live (waiters are woken by releases); while it is
        not, waiters still wake at the holder's expiry and at their own bound."""
        return self._listening

    def redis_key(self, key: str) -> str:
        """The Redis key (and release channel) of lock ``key``."""
        return f"{self._prefix}{{{_escape(key)}}}"

    def fence_key(self, key: str) -> str:
        """The Redis key of lock ``key``'s fencing counter."""
        return self.redis_key(key) + ":fence"

    def key_pattern(self) -> str:
        """A SCAN / PSUBSCRIBE pattern matching every key and channel of this namespace."""
        return self._prefix + "*"

    async def open(self) -> None:
        """Create the client and start the pub/sub listener. Idempotent. A Redis that is down
        does not make this fail (acquire raises LockUnavailable until it is back); it waits up
        to ``socket_timeout`` for the first subscription, so that waiters are woken from the
        start when Redis is up."""
        if self._open:
            return
        if self._client is None:
            assert self._url is not None
            # A blocking pool: a burst of callers beyond max_connections queues for a
            # connection (within each call's bound) instead of failing at once.
            pool = aioredis.BlockingConnectionPool.from_url(
                self._url,
                max_connections=self._max_connections,
                timeout=None,
                # No socket_timeout in redis-py: with one, it bounds each write with
                # asyncio.wait_for, which on Python 3.11 swallows a cancellation that lands as
                # the write completes (the caller's task then runs on as if never cancelled; a
                # lease watchdog would renew forever). Every call is bounded here instead, with
                # asyncio.timeout (see _call); the connect keeps its own bound.
                socket_timeout=None,
                socket_connect_timeout=self._socket_timeout,
                retry=Retry(NoBackoff(), 0),
                decode_responses=True,
                **_no_maintenance_probe(),
            )
            self._client = aioredis.Redis.from_pool(pool)
        client = self._client
        self._scripts = (
            client.register_script(_ACQUIRE),
            client.register_script(_RELEASE),
            client.register_script(_EXTEND),
        )
        self._open = True
        first_try = asyncio.Event()
        self._listener = asyncio.create_task(
            self._listen(first_try), name=f"flowlock-redis-listen:{self._namespace}"
        )
        try:
            async with asyncio.timeout(self._socket_timeout + _MIN_CALL):
                await first_try.wait()
        except TimeoutError:
            log.warning("flowlock: the Redis pub/sub subscription is not up yet; retrying")

    async def aclose(self) -> None:
        """Stop the listener, let releases in flight finish (each is bounded), close the client
        (unless it came from ``from_client``). Idempotent; ``open()`` may be called again."""
        if not self._open:
            return
        self._open = False
        self._wake_all()  # waiters see the backend closed at once instead of at their bound
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _require_open(self) -> aioredis.Redis:
        if not self._open or self._client is None:
            raise EngineClosed(
                "the Redis lock backend is not open; call `await locks.open()` or use "
                "`async with RedisLocks(...)` first"
            )
        return self._client

    # --- the lock --------------------------------------------------------------------------

    def acquire(self, key: str, *, ttl: float, wait: float = 0.0) -> LeaseContext:
        return LeaseContext(self, key, ttl=ttl, wait=wait, clock=self._clock)

    async def _acquire(self, key: str, ttl: float, wait: float) -> Lease:
        self._require_open()
        assert self._scripts is not None
        acquire_script = self._scripts[0]
        lock_key, fence_key = self.redis_key(key), self.fence_key(key)
        token = self._token()
        ttl_ms = _millis(ttl)
        started = self._clock()
        deadline = started + wait
        floor = "" if self._fence_floor is not None else "0"
        # Queued before the first attempt and kept until the end (wait=0 never waits): a release
        # published after an attempt was sent wakes the oldest waiter, however soon, and that
        # waiter retries at once instead of waiting.
        queue: _Queue | None = None
        waiter = _Waiter()
        if wait > 0:
            queue = self._queue(lock_key)
            queue.waiters[waiter] = None
        lease: Lease | None = None
        try:
            while True:
                self._require_open()
                waiter.event.clear()
                sent = self._clock()
                bound = (
                    self._socket_timeout
                    if wait <= 0
                    else min(self._socket_timeout, max(deadline - sent, _MIN_CALL))
                )
                try:
                    reply = await self._call(
                        "acquire",
                        acquire_script(keys=[lock_key, fence_key], args=[token, ttl_ms, floor]),
                        bound,
                    )
                except BaseException:
                    # The request may have reached Redis and taken the key for a token nobody
                    # will ever release: free it (best effort; it expires at its ttl anyway).
                    if self._open:
                        self._spawn(self._forget(lock_key, token))
                    raise
                status, value = int(reply[0]), int(reply[1])
                if status == 1:
                    lease = Lease(key, token, value, ttl, sent + ttl, self.name)
                    return lease
                if status == -1:
                    floor = str(await self._floor(key, deadline))
                    continue
                now = self._clock()
                if queue is None:
                    raise LockBusy(key)
                if value >= 0:
                    self._arm(lock_key, queue, value)
                left = deadline - now
                if left <= 0:
                    raise LockTimeout(key, now - started)
                if waiter.event.is_set():
                    continue  # woken while the attempt was in flight: the key may be free now
                # Someone holds the key: their release (or expiry) wakes the oldest waiter. One
                # that was woken and lost its retry to another holder keeps its place.
                waiter.woken = False
                await self._wait_for(waiter.event, left)
        finally:
            if queue is not None:
                del queue.waiters[waiter]
                if lease is None and (waiter.woken or waiter.event.is_set()):
                    # Handed the key's wake and leaving without the lease (timed out, cancelled,
                    # failed, closed): the next waiter takes it, or it sleeps while the key is free.
                    queue.wake_oldest()
                self._unqueue(lock_key, queue)

    async def release(self, lease: Lease) -> None:
        self._check_lease(lease)
        self._require_open()
        # Run to completion even if our caller is cancelled: the token is the lease's, so the
        # late compare-and-delete frees this lease's key or nothing.
        task = self._spawn(self._release(lease))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_log_late_failure)
            raise

    async def _release(self, lease: Lease) -> None:
        assert self._scripts is not None
        release_script = self._scripts[1]
        lock_key = self.redis_key(lease.key)
        deleted = await self._call(
            "release", release_script(keys=[lock_key], args=[lease.token]), self._socket_timeout
        )
        if int(deleted) != 1:
            raise LockNotOwned(lease.key, "release")

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        self._check_lease(lease)
        ttl = lease.ttl if ttl is None else ttl
        check_lock_args(lease.key, ttl, None)
        self._require_open()
        assert self._scripts is not None
        extend_script = self._scripts[2]
        lock_key = self.redis_key(lease.key)
        sent = self._clock()
        extended = await self._call(
            "extend",
            extend_script(keys=[lock_key], args=[lease.token, _millis(ttl)]),
            self._socket_timeout,
        )
        if int(extended) != 1:
            raise LockNotOwned(lease.key, "extend")
        return lease.renewed(sent + ttl, ttl)

    async def wait_released(self, key: str, wait: float) -> bool:
        """Wait, without taking the lock, until ``key`` is free: True as soon as it is seen free
        or its release or expiry is seen, False when ``wait`` seconds pass first. Every watcher
        is woken by a release (none competes for the lock or takes a waiter's wake). Raises
        LockUnavailable when Redis cannot be asked whether the key is held."""
        check_lock_args(key, 1.0, wait)
        client = self._require_open()
        lock_key = self.redis_key(key)
        deadline = self._clock() + wait
        watcher = _Watcher()
        # Registered before the key is looked at: a release between the look and the wait sets
        # the event, and the wait returns at once.
        queue = self._queue(lock_key)
        queue.watchers.add(watcher)
        try:
            while True:
                self._require_open()
                watcher.event.clear()
                bound = min(self._socket_timeout, max(deadline - self._clock(), _MIN_CALL))
                pttl = int(await self._call("wait_released", client.pttl(lock_key), bound))
                if watcher.released or pttl == -2:
                    return True
                left = deadline - self._clock()
                if left <= 0:
                    return False
                # Woken by a release, or at the holder's expiry (then look again: it may have
                # been extended), or by a new subscription (releases may have been missed), or
                # at our own bound.
                expiry = math.inf if pttl < 0 else pttl / 1000 + self._jitter()
                woken = await self._wait_for(watcher.event, min(left, expiry))
                if watcher.released:
                    return True
                if not woken and left <= expiry:
                    return False
        finally:
            queue.watchers.discard(watcher)
            self._unqueue(lock_key, queue)

    async def owned(self, lease: Lease) -> bool:
        self._check_lease(lease)
        client = self._require_open()
        lock_key = self.redis_key(lease.key)
        value = await self._call("owned", client.get(lock_key), self._socket_timeout)
        return _text(value) == lease.token

    async def locked(self, key: str) -> bool:
        check_lock_args(key, 1.0, None)
        client = self._require_open()
        lock_key = self.redis_key(key)
        count = await self._call("locked", client.exists(lock_key), self._socket_timeout)
        return int(count) > 0

    # --- helpers ---------------------------------------------------------------------------

    def _check_lease(self, lease: object) -> None:
        if not isinstance(lease, Lease) or lease.backend != self.name:
            raise InvalidInput(f"not a lease taken from a Redis lock backend: {lease!r}")

    def _jitter(self) -> float:
        return self._rng.uniform(0.0, _WAKE_JITTER)

    async def _call(self, what: str, call: Awaitable[T], seconds: float) -> T:
        """Await one Redis call for at most ``seconds``; every driver failure becomes
        LockUnavailable (the one place driver errors are translated)."""
        try:
            async with asyncio.timeout(seconds):
                return await call
        except TimeoutError as exc:
            raise LockUnavailable(self.name, f"{what}: no answer within {seconds:.2f} s") from exc
        except (RedisError, OSError) as exc:
            raise LockUnavailable(self.name, f"{what}: {exc}") from exc

    async def _floor(self, key: str, deadline: float) -> int:
        """The floor for a fencing counter Redis does not have: the highest token recorded
        outside Redis, plus the gap for tokens issued but never recorded. The acquirers of one
        key in this process share one ``fence_floor`` call (bounded by the first one's wait);
        its answer or its error goes to each of them."""
        bound = max(deadline - self._clock(), self._socket_timeout)
        flight = self._floors.get(key)
        if flight is None:
            flight = self._spawn(self._fetch_floor(key, bound))
            flight.add_done_callback(_retrieve)
            flight.add_done_callback(lambda done: self._landed(key, done))
            self._floors[key] = flight
        try:
            # Shielded: a sharer that is cancelled or gives up leaves the call to the others.
            async with asyncio.timeout(bound):
                return await asyncio.shield(flight)
        except TimeoutError as exc:
            raise LockUnavailable(
                self.name, f"fence_floor({key!r}) did not answer within {bound:.1f} s"
            ) from exc

    def _landed(self, key: str, flight: asyncio.Task[int]) -> None:
        if self._floors.get(key) is flight:
            del self._floors[key]

    async def _fetch_floor(self, key: str, bound: float) -> int:
        assert self._fence_floor is not None
        try:
            async with asyncio.timeout(bound):
                highest = await self._fence_floor(key)
        except TimeoutError as exc:
            raise LockUnavailable(
                self.name, f"fence_floor({key!r}) did not answer within {bound:.1f} s"
            ) from exc
        if isinstance(highest, bool) or not isinstance(highest, int) or highest < 0:
            raise InvalidInput(
                f"fence_floor({key!r}) must return a non-negative integer, not {highest!r}"
            )
        if highest:
            log.warning(
                "flowlock: the Redis fencing counter for %r was missing (Redis lost its data?); "
                "restarting it above %d + %d",
                key,
                highest,
                self._fence_gap,
            )
        return highest + self._fence_gap

    async def _forget(self, lock_key: str, token: str) -> None:
        assert self._scripts is not None
        release_script = self._scripts[1]
        try:
            await self._call(
                "release", release_script(keys=[lock_key], args=[token]), self._socket_timeout
            )
        except LockUnavailable as exc:
            log.debug("flowlock: could not clear an abandoned acquire on %r: %s", lock_key, exc)

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @staticmethod
    async def _wait_for(event: asyncio.Event, seconds: float) -> bool:
        """Whether ``event`` was set within ``seconds``."""
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            return False
        return True

    # --- pub/sub ---------------------------------------------------------------------------

    def _queue(self, lock_key: str) -> _Queue:
        queue = self._queues.get(lock_key)
        if queue is None:
            queue = self._queues[lock_key] = _Queue()
        return queue

    def _unqueue(self, lock_key: str, queue: _Queue) -> None:
        if not queue.waiters:
            queue.disarm()
            if not queue.watchers and self._queues.get(lock_key) is queue:
                del self._queues[lock_key]

    def _arm(self, lock_key: str, queue: _Queue, pttl_ms: int) -> None:
        """Wake the oldest waiter of ``lock_key`` when the holder's lease (``pttl_ms`` left, as
        a failed attempt saw it) runs out, unless an earlier wake-up is already set: one that
        comes too early (the holder extended) costs one attempt, which sets the next."""
        loop = asyncio.get_running_loop()
        at = loop.time() + pttl_ms / 1000 + self._jitter()
        if at < queue.timer_at:
            queue.disarm()
            queue.timer = loop.call_at(at, self._expired, queue)
            queue.timer_at = at

    @staticmethod
    def _expired(queue: _Queue) -> None:
        queue.timer, queue.timer_at = None, math.inf
        queue.wake_oldest()

    def _released(self, channel: str) -> None:
        queue = self._queues.get(channel)
        if queue is not None:
            queue.announce_release()

    def _missed(self) -> None:
        """A new subscription: releases may have been missed while there was none. The oldest
        waiter of each key retries, and every watcher looks again."""
        for queue in self._queues.values():
            queue.wake_oldest()
            for watcher in queue.watchers:
                watcher.event.set()

    def _wake_all(self) -> None:
        """The backend closed: every waiter and watcher finds out at once."""
        for queue in self._queues.values():
            for waiter in queue.waiters:
                waiter.event.set()
            for watcher in queue.watchers:
                watcher.event.set()

    async def _listen(self, first_try: asyncio.Event) -> None:
        """Keep one pattern subscription on this namespace's channels and wake the local
        waiters and watchers of each key released. Reconnects with backoff for as long as the
        backend is open; on each new subscription wakes the oldest waiter of each key and every
        watcher, since releases may have been missed while it was down."""
        delay = _RECONNECT_MIN
        failing = False
        while True:
            client = self._client
            assert client is not None
            pubsub = client.pubsub()
            try:
                async with asyncio.timeout(self._socket_timeout):
                    await pubsub.psubscribe(self.key_pattern())
                    while True:
                        message = await pubsub.get_message(timeout=self._socket_timeout)
                        if message is not None and message["type"] == "psubscribe":
                            break
                self._listening = True
                first_try.set()
                self._missed()
                if failing:
                    log.warning("flowlock: the Redis pub/sub subscription is back")
                failing = False
                delay = _RECONNECT_MIN
                await self._pump(pubsub)
            except Exception as exc:  # any failure: log it, reconnect, never die silently
                if not failing:
                    log.warning(
                        "flowlock: the Redis pub/sub subscription failed (%s); waiters fall back "
                        "to the holder's expiry until it is back",
                        exc,
                    )
                failing = True
            finally:
                self._listening = False
                first_try.set()
                await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay * (0.5 + self._rng.random()))
            delay = min(delay * 2, _RECONNECT_MAX)

    async def _pump(self, pubsub: PubSub) -> None:
        # Housekeeping time, not a lease deadline: the loop's own clock, not the injected one.
        clock = asyncio.get_running_loop().time
        last_heard = clock()
        pinged: float | None = None
        while True:
            message = await pubsub.get_message(timeout=_LISTEN_TICK)
            now = clock()
            if message is not None:
                last_heard, pinged = now, None
                if message["type"] == "pmessage":
                    channel = _text(message["channel"])
                    if channel is not None:
                        self._released(channel)
            elif pinged is not None:
                if now - pinged > self._socket_timeout:
                    raise TimeoutError("no answer to PING on the pub/sub connection")
            elif now - last_heard >= _PING_AFTER:
                await pubsub.ping()
                pinged = now


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A shared call whose every sharer gave up: its error is nobody's to raise (no "never
    # retrieved" warning).
    if not task.cancelled():
        task.exception()


def _log_late_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning(
            "flowlock: a release finished after its caller was cancelled and failed: %s",
            task.exception(),
        )
