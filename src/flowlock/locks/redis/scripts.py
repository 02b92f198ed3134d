"""The Lua scripts of the Redis lease protocol, and one typed caller per script.

Each script runs atomically, so no client can split its read from its write. That is
what makes "delete the key only if it is still mine" safe.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
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
    "start",
]

# The server's replication id. It changes when a replica is promoted or a primary starts empty.
# A counter stamped with another id may be behind: replication is asynchronous, so the dead
# primary may have issued tokens its replica never saw.
REPLID = """
local function replid()
  return string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)') or ''
end
"""

# KEYS[1] the lock key, KEYS[2] its fencing counter, KEYS[3] the counter's stamp (the
# replication id of the server that started it). All three share one hash slot.
# ARGV[1] the new owner's token.
# ARGV[2] the ttl in milliseconds.
# ARGV[3] "" when the backend has a floor: a missing counter is reported, not counted from 0.
#   "0" when it has none: a missing counter restarts at 1.
# ARGV[4] the span of one fencing epoch, "" without epochs. A counter about to cross into the
#   next epoch is reported as missing, so a new epoch is taken. So is one stamped by another
#   server (a failover since it was started).
# Returns {1, fencing token} when acquired, {0, the holder's PTTL in ms (-1: no expiry)} when
# held, or {-1, the counter (0: missing)} when START must run first; then call again.
# The lock is checked first, so a held lock never costs a floor.
# Counters stay below 2^53: Lua numbers are doubles, exact up to there.
ACQUIRE = (
    REPLID
    + """
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  return {0, pttl}
end
if ARGV[3] == '' then
  local fence = redis.call('GET', KEYS[2])
  if not fence then
    return {-1, 0}
  end
  if ARGV[4] ~= '' then
    if (tonumber(fence) + 1) % tonumber(ARGV[4]) == 0 then
      return {-1, tonumber(fence)}
    end
    if redis.call('GET', KEYS[3]) ~= replid() then
      return {-1, tonumber(fence)}
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
return {1, redis.call('INCR', KEYS[2])}
"""
)
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

# KEYS[1] a fencing counter, KEYS[2] its stamp. ARGV[1] its floor, ARGV[2] "1" to stamp it.
# Raises a missing or lower counter to the floor, stamped with this server's replication id when
# asked. Returns 1 if it did, 0 otherwise. It never lowers a counter: another acquirer's start
# stays. A counter left alone keeps its stamp. If that stamp is a pre-failover server's, the next
# acquire takes a new epoch above it.
START = (
    REPLID
    + """
local fence = redis.call('GET', KEYS[1])
if (not fence) or tonumber(fence) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  if ARGV[2] == '1' then
    redis.call('SET', KEYS[2], replid())
  end
  return 1
end
return 0
"""
)

Scripts = tuple[AsyncScript, AsyncScript, AsyncScript, AsyncScript]
"""The scripts registered on one client: acquire, release, extend, start, in that order. A plain
tuple, so that a test can wrap one of them in something that counts or delays its calls."""


def register(client: aioredis.Redis | RedisCluster) -> Scripts:
    """Register the scripts on `client`.

    Each call sends EVALSHA, and the script text only when the server lacks it (after a
    restart or failover). In a cluster EVALSHA goes to its keys' slot; each script touches
    one lock's keys, which share a hash tag.
    """
    return (
        client.register_script(ACQUIRE),
        client.register_script(RELEASE),
        client.register_script(EXTEND),
        client.register_script(START),
    )


def acquire(
    scripts: Scripts,
    *,
    lock_key: str,
    fence_key: str,
    stamp_key: str,
    token: str,
    ttl_ms: int,
    unknown: str,
    span: str,
) -> Awaitable[Any]:
    """Take the lock for `token`.

    Replies `[ACQUIRED, fencing]`, `[HELD, pttl_ms]` or `[NO_COUNTER, counter]`. On the
    last, start the counter and call again. `unknown` and `span` are ARGV[3] and ARGV[4]
    (see `ACQUIRE`).
    """
    return scripts[0](keys=[lock_key, fence_key, stamp_key], args=[token, ttl_ms, unknown, span])


def release(scripts: Scripts, *, lock_key: str, token: str) -> Awaitable[Any]:
    """Delete the lock if `token` holds it and announce the release: 1 if it did, else 0."""
    return scripts[1](keys=[lock_key], args=[token])


def extend(scripts: Scripts, *, lock_key: str, token: str, ttl_ms: int) -> Awaitable[Any]:
    """Reset the lock's expiry to `ttl_ms` if `token` holds it: 1 if it did, else 0."""
    return scripts[2](keys=[lock_key], args=[token, ttl_ms])


def start(
    scripts: Scripts, *, fence_key: str, stamp_key: str, floor: int, stamp: bool
) -> Awaitable[Any]:
    """Raise the counter `fence_key` to `floor` if it is missing or below. Returns 1 if it did.

    With `stamp`, also stamp `stamp_key` with the server's replication id.
    """
    return scripts[3](keys=[fence_key, stamp_key], args=[floor, "1" if stamp else ""])
