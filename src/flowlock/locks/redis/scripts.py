"""The Lua scripts of the Redis lease protocol, and one typed caller per script.

Each script runs atomically, so no client can split its read from its write. That is
what makes "delete the key only if it is still mine" safe.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

__all__ = [
    "ACQUIRED",
    "HELD",
    "NO_COUNTER",
    "BulkScripts",
    "Scripts",
    "acquire",
    "acquire_many",
    "extend",
    "extend_many",
    "register",
    "register_bulk",
    "release",
    "release_many",
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

# The same three scripts over many locks, for one round trip. Each lock is handled exactly as
# its one-lock script would, in order; a lock named twice finds itself held the second time.
# In a cluster every key of one call must share a hash slot: the caller groups locks by slot.

# KEYS: three per lock (its key, fencing counter and stamp, as in ACQUIRE).
# ARGV[1], ARGV[2]: ACQUIRE's ARGV[3] and ARGV[4], for every lock. Then per lock i its token
# (ARGV[2i+1]) and ttl in milliseconds (ARGV[2i+2]).
# Returns ACQUIRE's pair for each lock, flattened: {status1, value1, status2, value2, ...}.
# The replication id is read once per call, and only when a counter needs it.
ACQUIRE_MANY = (
    REPLID
    + """
local out = {}
local rid = nil
local unknown, span = ARGV[1], ARGV[2]
for i = 1, #KEYS / 3 do
  local lock, fence_key, stamp_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local status, value = 1, 0
  local pttl = redis.call('PTTL', lock)
  if pttl ~= -2 then
    status, value = 0, pttl
  elseif unknown == '' then
    local fence = redis.call('GET', fence_key)
    if not fence then
      status, value = -1, 0
    elseif span ~= '' then
      if (tonumber(fence) + 1) % tonumber(span) == 0 then
        status, value = -1, tonumber(fence)
      else
        if rid == nil then
          rid = replid()
        end
        if redis.call('GET', stamp_key) ~= rid then
          status, value = -1, tonumber(fence)
        end
      end
    end
  end
  if status == 1 then
    redis.call('SET', lock, ARGV[2 * i + 1], 'NX', 'PX', ARGV[2 * i + 2])
    value = redis.call('INCR', fence_key)
  end
  out[2 * i - 1] = status
  out[2 * i] = value
end
return out
"""
)

# KEYS: the lock keys. ARGV[i]: the token of KEYS[i]. Returns RELEASE's answer for each.
RELEASE_MANY = """
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then
    redis.call('DEL', KEYS[i])
    redis.call('PUBLISH', KEYS[i], '')
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# KEYS: the lock keys. ARGV[2i-1], ARGV[2i]: the token and new ttl in ms of KEYS[i].
# Returns EXTEND's answer for each.
EXTEND_MANY = """
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i - 1] then
    out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
  else
    out[i] = 0
  end
end
return out
"""

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


BulkScripts = tuple[AsyncScript, AsyncScript, AsyncScript]
"""The many-lock scripts registered on one client: acquire, release, extend."""


def register_bulk(client: aioredis.Redis | RedisCluster) -> BulkScripts:
    """Register the many-lock scripts on `client` (sent as EVALSHA, as `register` says)."""
    return (
        client.register_script(ACQUIRE_MANY),
        client.register_script(RELEASE_MANY),
        client.register_script(EXTEND_MANY),
    )


def acquire_many(
    scripts: BulkScripts,
    *,
    keys: Sequence[str],
    owners: Sequence[str | int],
    unknown: str,
    span: str,
    client: Any = None,
) -> Awaitable[Any]:
    """Try many locks at once. `keys` holds three keys per lock (lock, counter, stamp) and
    `owners` two values (token, ttl in ms). Replies ACQUIRE's pairs, flattened.

    With a cluster pipeline as `client` the call is queued on it (awaiting it only queues)."""
    return scripts[0](keys=list(keys), args=[unknown, span, *owners], client=client)


def release_many(
    scripts: BulkScripts, *, lock_keys: Sequence[str], tokens: Sequence[str], client: Any = None
) -> Awaitable[Any]:
    """Release many locks at once: for each, 1 if its token held it and it was deleted."""
    return scripts[1](keys=list(lock_keys), args=list(tokens), client=client)


def extend_many(
    scripts: BulkScripts,
    *,
    lock_keys: Sequence[str],
    owners: Sequence[str | int],
    client: Any = None,
) -> Awaitable[Any]:
    """Extend many locks at once; `owners` holds a token and a ttl in ms per lock. For each,
    1 if its token held it and its expiry was reset."""
    return scripts[2](keys=list(lock_keys), args=list(owners), client=client)


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
