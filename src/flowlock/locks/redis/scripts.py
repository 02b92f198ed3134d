"""The three Lua scripts the Redis lease protocol runs, what each one's KEYS and ARGV are, and
one typed function per script that passes them in the right order.

Each script runs atomically on the server, so the read and the write in it cannot be split by
another client: that is what makes "delete the key only if it is still mine" safe.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

__all__ = [
    "ACQUIRED",
    "HELD",
    "NO_COUNTER",
    "Scripts",
    "acquire",
    "extend",
    "register",
    "release",
]

# KEYS[1] the lock key, KEYS[2] its fencing counter (same hash slot).
# ARGV[1] the new owner's token, ARGV[2] the ttl in milliseconds,
# ARGV[3] the floor for a missing fencing counter: "" when the client has not fetched one yet.
# Returns {1, fencing token} when acquired; {0, the holder's PTTL in ms (-1: no expiry)} when
# held; {-1, 0} when the counter is missing and no floor was passed (the client fetches the
# floor and calls again). The lock is checked first, so a held lock never costs a floor fetch.
ACQUIRE = """
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
# The first element of the acquire script's reply.
ACQUIRED = 1
HELD = 0
NO_COUNTER = -1

# KEYS[1] the lock key (also the channel its release is announced on).
# ARGV[1] the releasing lease's token.
# Returns 1 when the key held that token and was deleted (and waiters told), 0 otherwise: a
# lease that expired never deletes the key of whoever holds it now.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], '')
  return 1
end
return 0
"""

# KEYS[1] the lock key. ARGV[1] the lease's token, ARGV[2] the new ttl in milliseconds.
# Returns 1 when the key held that token and its expiry was reset, 0 otherwise.
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

Scripts = tuple[AsyncScript, AsyncScript, AsyncScript]
"""The scripts registered on one client: acquire, release, extend, in that order. A plain tuple,
so that a test can wrap one of them in something that counts or delays its calls."""


def register(client: aioredis.Redis) -> Scripts:
    """Register the scripts on ``client``: each call sends EVALSHA, and the script text only
    when the server does not have it (after a restart, say)."""
    return (
        client.register_script(ACQUIRE),
        client.register_script(RELEASE),
        client.register_script(EXTEND),
    )


def acquire(
    scripts: Scripts,
    *,
    lock_key: str,
    fence_key: str,
    token: str,
    ttl_ms: int,
    floor: str,
) -> Awaitable[Any]:
    """Take the lock for ``token``: a reply ``[ACQUIRED, fencing]``, ``[HELD, pttl_ms]`` or
    ``[NO_COUNTER, 0]`` (fetch the floor and call again with it)."""
    return scripts[0](keys=[lock_key, fence_key], args=[token, ttl_ms, floor])


def release(scripts: Scripts, *, lock_key: str, token: str) -> Awaitable[Any]:
    """Delete the lock if ``token`` holds it and announce the release: 1 if it did, else 0."""
    return scripts[1](keys=[lock_key], args=[token])


def extend(scripts: Scripts, *, lock_key: str, token: str, ttl_ms: int) -> Awaitable[Any]:
    """Reset the lock's expiry to ``ttl_ms`` if ``token`` holds it: 1 if it did, else 0."""
    return scripts[2](keys=[lock_key], args=[token, ttl_ms])
