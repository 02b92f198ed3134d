"""RedisLocks' many-lock calls (BulkLockBackend): try, release and extend many keys at once.

Kept apart from `backend` by size. Each runs the many-lock scripts once (once per hash slot
on a cluster) and answers per key, as the one-key calls would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flowlock.core.errors import EngineClosed, InvalidInput, LockBusy, LockUnavailable
from flowlock.locks.base import Lease, check_lock_key, check_ttl
from flowlock.locks.redis import bulk, scripts
from flowlock.locks.redis.connection import log_late_failure, millis

if TYPE_CHECKING:
    from flowlock.locks.redis.backend import RedisLocks

__all__ = ["extend_many", "release_many", "try_acquire_many"]


def _listed(what: str, items: object) -> list[object]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidInput(f"{what} must be a list, not {type(items).__name__}")
    return list(items)


async def try_acquire_many(
    locks: RedisLocks, keys: Sequence[str], ttl: float
) -> list[Lease | None]:
    """A Lease for each key taken, None for each key held by someone else, in `keys`' order.

    Bad input raises InvalidInput before anything is sent. On LockUnavailable nothing stays
    held: what was taken is released (or expires at its ttl).
    """
    checked = [check_lock_key(k) for k in _listed("keys", keys)]
    ttl = check_ttl(ttl)
    locks._require_open()
    runner = locks._runner
    assert runner is not None
    if not checked:
        return []
    timeout = locks._socket_timeout
    attempts = [
        bulk.Attempt.of(locks._keys, k, locks._token(), millis(ttl), timeout) for k in checked
    ]
    sent = locks._clock()
    fence = locks._fence
    try:
        answers = await runner.acquire(
            attempts, unknown=fence.unknown, span=fence.span, bound=timeout
        )
    except BaseException:
        _forget(locks, attempts)
        raise
    leases: list[Lease | None] = [None] * len(checked)
    try:
        await _answered(locks, checked, ttl, sent, attempts, answers, leases)
    except BaseException as exc:
        # Failed or cancelled (even during the retries below): what was taken goes back.
        taken = [lease for lease in leases if lease is not None]
        if taken and locks._open:
            task = locks._spawn(_give_back(locks, taken))
            if not isinstance(exc, asyncio.CancelledError):
                await asyncio.shield(task)
        raise
    return leases


async def _answered(
    locks: RedisLocks,
    keys: list[str],
    ttl: float,
    sent: float,
    attempts: list[bulk.Attempt],
    answers: Sequence[tuple[int, int] | BaseException],
    leases: list[Lease | None],
) -> None:
    """Fill `leases` from the script's `answers`: each key taken, or tried again alone when its
    counter must be started first. Raises the first failure; `leases` then holds what was
    taken (filled as each lease comes, so a cancelled caller can give them back)."""
    failed: BaseException | None = None
    missing: list[int] = []
    for i, (a, answer) in enumerate(zip(attempts, answers, strict=True)):
        if isinstance(answer, BaseException):
            failed = failed or answer
            _forget(locks, [a])
        elif answer[0] == scripts.ACQUIRED:
            leases[i] = Lease(a.key, a.token, answer[1], ttl, sent + ttl, locks.name)
        elif answer[0] == scripts.NO_COUNTER:
            missing.append(i)
    if failed is None and missing:
        # A counter to start first (missing, or at its epoch's end): the one-key path starts it
        # from the fence floor and tries again, once per such key.

        async def again(i: int) -> None:
            leases[i] = await _try_one(locks, keys[i], ttl)

        done = await asyncio.gather(*(again(i) for i in missing), return_exceptions=True)
        failed = next((e for e in done if isinstance(e, BaseException)), None)
    if failed is not None:
        raise failed


async def _give_back(locks: RedisLocks, leases: Sequence[Lease]) -> None:
    with contextlib.suppress(LockUnavailable, EngineClosed):  # else they expire at their ttl
        await release_many(locks, leases)


async def _try_one(locks: RedisLocks, key: str, ttl: float) -> Lease | None:
    try:
        return await locks._acquire(key, ttl, 0.0)
    except LockBusy:
        return None


def _forget(locks: RedisLocks, attempts: Sequence[bulk.Attempt]) -> None:
    """Free what a failed or abandoned call may have taken (best effort)."""
    for a in attempts:
        locks._abandon(a.lock_key, a.token)


def _holds(locks: RedisLocks, leases: Sequence[Lease], ttl_ms: int = 0) -> list[bulk.Hold]:
    checked = _listed("leases", leases)
    for lease in checked:
        locks._check_lease(lease)
    return [bulk.Hold(locks.redis_key(le.key), le.token, ttl_ms) for le in leases]


async def release_many(locks: RedisLocks, leases: Sequence[Lease]) -> list[bool]:
    """True for each lease that was still ours and is now released, False for each that had
    expired (whoever holds the key now keeps it). Completes even if the caller is cancelled."""
    holds = _holds(locks, leases)
    locks._require_open()
    runner = locks._runner
    assert runner is not None
    if not holds:
        return []
    task = locks._spawn(runner.release(holds, bound=locks._socket_timeout))
    try:
        answers = await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(log_late_failure)  # it finishes on its own
        raise
    return [_answer(answer) == 1 for answer in answers]


async def extend_many(locks: RedisLocks, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
    """Each lease pushed to `ttl` from now, or None where it was lost."""
    ttl = check_ttl(ttl)
    holds = _holds(locks, leases, millis(ttl))
    locks._require_open()
    runner = locks._runner
    assert runner is not None
    if not holds:
        return []
    sent = locks._clock()
    answers = await runner.extend(holds, bound=locks._socket_timeout)
    return [
        lease.renewed(sent + ttl, ttl) if _answer(answer) == 1 else None
        for lease, answer in zip(leases, answers, strict=True)
    ]


def _answer(answer: int | BaseException) -> int:
    if isinstance(answer, BaseException):
        raise answer
    return answer
