"""The advisory backend's SQL: fencing counters, pg_locks questions, a lease's first trip."""

from __future__ import annotations

import hashlib
import math

# $1 namespace, $2 key. Autocommit on the side pool: durable once it returns.
NEXT_FENCE = """
INSERT INTO flowlock_fences AS f (namespace, key, token) VALUES ($1, $2, 1)
ON CONFLICT (namespace, key) DO UPDATE SET token = f.token + 1
RETURNING token
"""
# A holder's one statement (docs/deployment.md, "Advisory leases in bulk"), in autocommit: the
# keys being released are freed ($1 lock ids), the keys being taken are tried ($2 lock ids, $3
# keys) and each one taken gets its fencing token ($4 namespace), and the session's idle timer is
# set ($5 milliseconds, '0' off). Session-level locks: a key stays held after the statement and
# is freed by its own unlock, or when the session ends. The tokens come back after the commit,
# in the order of $2 (0 where the key is held elsewhere). The caller never repeats a lock id it
# holds (the locks are re-entrant within a session), so no fencing row is touched twice.
HOLD = """
WITH freed AS MATERIALIZED (
    SELECT u.ord, pg_advisory_unlock(u.k) AS ok
      FROM unnest($1::bigint[]) WITH ORDINALITY AS u(k, ord)
), tried AS MATERIALIZED (
    SELECT t.ord, t.key, pg_try_advisory_lock(t.k) AS got
      FROM unnest($2::bigint[], $3::text[]) WITH ORDINALITY AS t(k, key, ord)
), fenced AS (
    INSERT INTO flowlock_fences AS f (namespace, key, token)
    SELECT $4, tried.key, 1 FROM tried WHERE tried.got
    ON CONFLICT (namespace, key) DO UPDATE SET token = f.token + 1
    RETURNING f.key, f.token
)
SELECT set_config('idle_session_timeout', $5, false) AS idle,
       ARRAY(SELECT ok FROM freed ORDER BY ord) AS freed,
       ARRAY(SELECT coalesce(x.token, 0) FROM tried t LEFT JOIN fenced x ON x.key = t.key
              ORDER BY t.ord) AS tokens
"""
# A holder's first statement: its process id (what pg_locks shows), and a lock_timeout for the
# one row lock it may wait for ($1 milliseconds).
HOLDER_SETUP = "SELECT pg_backend_pid(), set_config('lock_timeout', $1, false)"
# Whether the server can end a quiet holder (idle_session_timeout came in PostgreSQL 14).
BULK_SUPPORTED = "SELECT current_setting('server_version_num')::int >= 140000"
FENCE_FLOOR = "SELECT token FROM flowlock_fences WHERE namespace = $1 AND key = $2"
# A bigint advisory lock shows in pg_locks as classid = high 32 bits, objid = low 32 bits,
# objsubid = 1 (the two-int4 form uses objsubid = 2). $1 classid, $2 objid.
LOCKED = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
     WHERE locktype = 'advisory' AND granted
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1
)
"""
# $1 the lease's server pid, $2 classid, $3 objid.
HELD_BY = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
     WHERE locktype = 'advisory' AND granted AND pid = $1
       AND classid = $2::bigint::oid AND objid = $3::bigint::oid AND objsubid = 1
)
"""


def advisory_lock_id(scope: str, namespace: str, key: str) -> int:
    """The advisory lock number of `key`: the first 8 bytes of a BLAKE2b digest of
    (scope, namespace, key), as a signed bigint. Stable across processes, versions and
    platforms (it is part of the on-server protocol: changing it would let an old and a new
    client hold "the same" lock at once)."""
    digest = hashlib.blake2b(
        "\x1f".join((scope, namespace, key)).encode("utf-8"), digest_size=8, person=b"flowlock"
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


def ms(seconds: float) -> int:
    # Rounded up: the server's bound is never shorter than the one the caller asked for.
    return max(1, math.ceil(seconds * 1000))


def oids(lock: int) -> tuple[int, int]:
    unsigned = lock & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


def begin(lock: int, ttl: float, wait_left: float | None) -> str:
    """The first round trip of a lease, as one simple-protocol query. Only numbers are
    interpolated (the key reaches the server as a hash), so there is nothing to inject."""
    idle = f"SET LOCAL idle_in_transaction_session_timeout = '{ms(ttl)}ms'"
    if wait_left is None:
        # Why a DO block: it raises SQLSTATE 55P03 when the lock is taken, so "busy" comes back
        # as an error in this same round trip (a simple query returns no rows to asyncpg).
        return (
            f"BEGIN; {idle}; DO $$BEGIN IF NOT pg_try_advisory_xact_lock('{lock}'::bigint) THEN "
            "RAISE EXCEPTION USING ERRCODE = 'lock_not_available', "
            "MESSAGE = 'flowlock: advisory lock is held'; END IF; END$$"
        )
    return (
        f"BEGIN; SET LOCAL lock_timeout = '{ms(wait_left)}ms'; {idle}; "
        f"SELECT pg_advisory_xact_lock('{lock}'::bigint)"
    )
