-- Capacities, uniqueness and rate limits (see the PostgreSQL migration and
-- flowlock.stores.constraint_store): changed by a commit in the transaction of its
-- compare-and-swap. SQLite has one writer at a time, so the write lock serializes every key.
-- Times (`at`) are epoch seconds on the wall clock of the host that wrote them.

-- A key's counter: holders now, the limit last used, the last event's number.
CREATE TABLE flowlock_capacity (
    kind    TEXT    NOT NULL,
    key     TEXT    NOT NULL,
    holders INTEGER NOT NULL CHECK (holders >= 0),
    lim     INTEGER NOT NULL,
    seq     INTEGER NOT NULL,
    PRIMARY KEY (kind, key)
);

-- The slots held now: an instance holds at most one of a kind.
CREATE TABLE flowlock_slots (
    kind        TEXT    NOT NULL,
    instance_id TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    version     INTEGER NOT NULL,
    PRIMARY KEY (kind, instance_id)
);
CREATE INDEX flowlock_slots_key ON flowlock_slots (kind, key);

-- Every take (+1) and release (-1), numbered per key from 1: the checker's proof.
CREATE TABLE flowlock_slot_log (
    kind        TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    seq         INTEGER NOT NULL,
    instance_id TEXT    NOT NULL,
    version     INTEGER NOT NULL,
    delta       INTEGER NOT NULL CHECK (delta IN (-1, 1)),
    holders     INTEGER NOT NULL,
    lim         INTEGER NOT NULL,
    at          REAL    NOT NULL,
    PRIMARY KEY (kind, key, seq)
);

-- Every application counted against a rate limit.
CREATE TABLE flowlock_rate_log (
    kind        TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    at          REAL    NOT NULL,
    instance_id TEXT    NOT NULL,
    version     INTEGER NOT NULL,
    lim         INTEGER NOT NULL,
    per         REAL    NOT NULL
);
CREATE INDEX flowlock_rate_log_key ON flowlock_rate_log (kind, key, at);
