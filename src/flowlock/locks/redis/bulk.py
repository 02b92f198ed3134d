"""Many locks per round trip: the many-lock scripts, grouped by cluster slot, and the lanes that
coalesce a backend's single-key calls onto them.

A single-key call goes out alone while fewer than `DEPTH` calls of its kind are in flight.
Calls that arrive while the lanes are full queue, and the next free slot sends them all as one
script call (one per hash slot on a cluster, sent together). Each lock is handled by the script
exactly as by its one-lock script, so every per-key property holds. docs/redis-ha.md says more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from flowlock._batching import Coalescer
from flowlock.core.errors import LockUnavailable
from flowlock.locks.redis import scripts
from flowlock.locks.redis.connection import Client, bounded, translate
from flowlock.locks.redis.keys import Keyspace

__all__ = ["DEPTH", "MAX_BATCH", "Attempt", "Hold", "Lanes", "Runner"]

T = TypeVar("T")

# Round trips of one kind (acquire, release, extend) in flight at once before calls queue.
# Small: Redis runs one script at a time, so more in flight only adds queueing there.
DEPTH = 3
# The most locks one coalesced call carries; a script over them stays well under a millisecond.
MAX_BATCH = 256


@dataclass(slots=True)
class Attempt:
    """One try of one lock for one token. `bound` is the caller's bound on the call.
    `abandoned` is set when its caller gave up, so a late success is released."""

    key: str
    lock_key: str
    fence_key: str
    stamp_key: str
    token: str
    ttl_ms: int
    bound: float
    abandoned: bool = False

    @classmethod
    def of(cls, keys: Keyspace, key: str, token: str, ttl_ms: int, bound: float) -> Attempt:
        lock, fence, stamp = keys.all_three(key)
        return cls(key, lock, fence, stamp, token, ttl_ms, bound)


@dataclass(frozen=True, slots=True)
class Hold:
    """A held lock to release or extend: its Redis key, its token, the new ttl (extend)."""

    lock_key: str
    token: str
    ttl_ms: int = 0


class Runner:
    """Runs the many-lock scripts over any locks: one call on one server (or a Sentinel's
    primary), one call per hash slot on a cluster, all sent at once. Each answer is the lock's
    own reply, or the LockUnavailable of the call that carried it."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._scripts = scripts.register_bulk(client)
        self._cluster = isinstance(client, RedisCluster)
        self.round_trips = 0  # script calls sent (tests count them)

    def _groups(self, lock_keys: Sequence[str]) -> list[list[int]]:
        """The positions of `lock_keys` that one script call may carry together."""
        if not self._cluster:
            return [list(range(len(lock_keys)))]
        slots: dict[int, list[int]] = {}
        for i, lock_key in enumerate(lock_keys):
            slots.setdefault(key_slot(lock_key.encode()), []).append(i)
        return list(slots.values())

    async def _run(
        self,
        what: str,
        lock_keys: Sequence[str],
        call: Call,
        width: int,
        bound: float,
    ) -> list[Any]:
        """`call(group)` for each group; each reply cut into `width` values per lock."""
        groups = self._groups(lock_keys)
        if len(groups) == 1:
            self.round_trips += 1
            replies: list[Any] = [await _caught(bounded(what, call(groups[0], None), bound))]
        else:
            replies = await self._pipelined(what, lock_keys, groups, call, bound)
        answers: list[Any] = [None] * len(lock_keys)
        for group, reply in zip(groups, replies, strict=True):
            for n, i in enumerate(group):
                if isinstance(reply, BaseException):
                    answers[i] = reply
                elif width == 1:
                    answers[i] = int(reply[n])
                else:
                    answers[i] = (int(reply[2 * n]), int(reply[2 * n + 1]))
        return answers

    async def _pipelined(
        self,
        what: str,
        lock_keys: Sequence[str],
        groups: list[list[int]],
        call: Call,
        bound: float,
    ) -> list[Any]:
        """The groups' script calls in one cluster pipeline: one round trip per node. When a
        node lacks the script (NOSCRIPT: it restarted, or a replica was promoted), the script
        is loaded on every primary and those groups go again, in one more pipeline. Nothing
        else is resent: a compare-and-delete that landed must not run twice."""
        replies: list[Any] = [None] * len(groups)
        todo = list(range(len(groups)))
        for _ in range(2):
            sent = await self._pipeline(what, lock_keys, [groups[n] for n in todo], call, bound)
            again = []
            for n, reply in zip(todo, sent, strict=True):
                replies[n] = reply
                if isinstance(reply, NoScriptError):
                    again.append(n)
            if not again:
                break
            script = self._scripts[_SCRIPT[what]]
            loaded = await _caught(bounded(what, self._client.script_load(script.script), bound))
            if isinstance(loaded, LockUnavailable):
                for n in again:
                    replies[n] = loaded
                break
            self.round_trips += 1
            todo = again
        return [
            translate(what, r, bound)
            if isinstance(r, BaseException) and not isinstance(r, LockUnavailable)
            else r
            for r in replies
        ]

    async def _pipeline(
        self,
        what: str,
        lock_keys: Sequence[str],
        groups: list[list[int]],
        call: Call,
        bound: float,
    ) -> list[Any]:
        """One pipeline over the groups: each group's reply or error."""
        assert isinstance(self._client, RedisCluster)
        pipe = self._client.pipeline()
        for group in groups:
            await call(group, pipe)  # queues only
        try:
            return list(await bounded(what, pipe.execute(raise_on_error=False), bound))
        except LockUnavailable as exc:
            return [exc] * len(groups)
        finally:
            self.round_trips += self._nodes(lock_keys, groups)

    def _nodes(self, lock_keys: Sequence[str], groups: list[list[int]]) -> int:
        """How many nodes the groups went to, as far as the client knows (for the count)."""
        assert isinstance(self._client, RedisCluster)
        try:
            client = self._client
            nodes = {getattr(client.get_node_from_key(lock_keys[g[0]]), "name", "") for g in groups}
        except Exception:  # the slot map is unknown or moving: count a call per group
            return len(groups)
        return len(nodes)

    async def acquire(
        self, attempts: Sequence[Attempt], *, unknown: str, span: str, bound: float
    ) -> list[tuple[int, int] | BaseException]:
        """ACQUIRE's (status, value) for each attempt, or its call's error."""

        def call(group: list[int], client: Any) -> Awaitable[Any]:
            keys: list[str] = []
            owners: list[str | int] = []
            for i in group:
                a = attempts[i]
                keys += (a.lock_key, a.fence_key, a.stamp_key)
                owners += (a.token, a.ttl_ms)
            return scripts.acquire_many(
                self._scripts, keys=keys, owners=owners, unknown=unknown, span=span, client=client
            )

        return await self._run("acquire", [a.lock_key for a in attempts], call, 2, bound)

    async def release(self, holds: Sequence[Hold], *, bound: float) -> list[int | BaseException]:
        """1 for each lock released, 0 where the token no longer held it, or its call's error."""

        def call(group: list[int], client: Any) -> Awaitable[Any]:
            return scripts.release_many(
                self._scripts,
                lock_keys=[holds[i].lock_key for i in group],
                tokens=[holds[i].token for i in group],
                client=client,
            )

        return await self._run("release", [h.lock_key for h in holds], call, 1, bound)

    async def extend(self, holds: Sequence[Hold], *, bound: float) -> list[int | BaseException]:
        """1 for each lock extended, 0 where the token no longer held it, or its call's error."""

        def call(group: list[int], client: Any) -> Awaitable[Any]:
            owners: list[str | int] = []
            for i in group:
                owners += (holds[i].token, holds[i].ttl_ms)
            return scripts.extend_many(
                self._scripts,
                lock_keys=[holds[i].lock_key for i in group],
                owners=owners,
                client=client,
            )

        return await self._run("extend", [h.lock_key for h in holds], call, 1, bound)


One = Callable[[T], Awaitable[Any]]
_SCRIPT = {"acquire": 0, "release": 1, "extend": 2}  # a call's script in BulkScripts
Call = Callable[[list[int], Any], Awaitable[Any]]
"""One script call over a group of positions, on the client (None) or queued on a pipeline."""


async def _caught(call: Awaitable[T]) -> T | LockUnavailable:
    """The call's reply, or its LockUnavailable as a value (it is the answer of its group)."""
    try:
        return await call
    except LockUnavailable as exc:
        return exc


class Lanes:
    """A backend's single-key acquires, releases and extends, coalesced onto the Runner.

    `fence()` gives the acquire script's ARGV (unknown, span) at send time. `forget(lock_key,
    token)` frees a lock taken for a caller that gave up meanwhile.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        socket_timeout: float,
        fence: Callable[[], tuple[str, str]],
        forget: Callable[[str, str], object],
    ) -> None:
        self.runner = runner
        self._timeout = socket_timeout
        self._fence = fence
        self._forget = forget
        self._acquires: Coalescer[Attempt, Any] = Coalescer(
            self._acquire_many, depth=DEPTH, max_batch=MAX_BATCH
        )
        self._releases: Coalescer[Hold, Any] = Coalescer(
            self._release_many, depth=DEPTH, max_batch=MAX_BATCH
        )
        self._extends: Coalescer[Hold, Any] = Coalescer(
            self._extend_many, depth=DEPTH, max_batch=MAX_BATCH
        )

    async def acquire(self, attempt: Attempt, one: One[Attempt]) -> Any:
        """The acquire script's reply for `attempt`, alone or in a batch, within its own bound
        (time spent queued included: a batch runs with the longest bound in it)."""
        try:
            return await bounded("acquire", self._acquires.submit(attempt, one), attempt.bound)
        except BaseException:
            attempt.abandoned = True
            raise

    async def release(self, hold: Hold, one: One[Hold]) -> Any:
        """The release script's reply for `hold`, alone or in a batch."""
        return await self._releases.submit(hold, one)

    async def extend(self, hold: Hold, one: One[Hold]) -> Any:
        """The extend script's reply for `hold`, alone or in a batch."""
        return await self._extends.submit(hold, one)

    async def _acquire_many(self, attempts: Sequence[Attempt]) -> Sequence[Any]:
        unknown, span = self._fence()
        # The longest bound of the batch: a shorter one would fail the others' calls early.
        bound = min(self._timeout, max(a.bound for a in attempts))
        try:
            answers = await self.runner.acquire(attempts, unknown=unknown, span=span, bound=bound)
        except BaseException:
            for a in attempts:
                self._forget(a.lock_key, a.token)
            raise
        out: list[Any] = []
        for a, answer in zip(attempts, answers, strict=True):
            if isinstance(answer, BaseException):
                # The call may have reached Redis and taken the key: free it (it expires anyway).
                self._forget(a.lock_key, a.token)
                out.append(answer)
                continue
            if a.abandoned and answer[0] == scripts.ACQUIRED:
                self._forget(a.lock_key, a.token)
            out.append(list(answer))
        return out

    async def _release_many(self, holds: Sequence[Hold]) -> Sequence[Any]:
        return await self.runner.release(holds, bound=self._timeout)

    async def _extend_many(self, holds: Sequence[Hold]) -> Sequence[Any]:
        return await self.runner.extend(holds, bound=self._timeout)

    async def drain(self) -> None:
        """Wait for the batches already sent."""
        for lane in (self._acquires, self._releases, self._extends):
            await lane.drain()
