-- The transactional outbox: one row per message a transition emitted, written in the
-- transaction of the commit that applied it (a lost compare-and-swap writes none). The key is
-- '<instance_id>:<version>:<n>', the message's idempotency key, unique forever.
-- Stored statuses are pending, done and dead; a pending row with a live claim reads as running.
-- SQLite has no server clock: due_at, created_at, done_at and claimed_until are epoch seconds on
-- the wall clock of the host that wrote them, as for the timers (006_timers.sql).
CREATE TABLE flowlock_outbox (
    instance_id   TEXT    NOT NULL,
    version       INTEGER NOT NULL,
    n             INTEGER NOT NULL CHECK (n >= 0),
    key           TEXT    NOT NULL UNIQUE,
    workflow      TEXT    NOT NULL,
    kind          TEXT    NOT NULL,
    payload       TEXT    NOT NULL,
    status        TEXT    NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'done', 'dead')),
    attempts      INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    fencing_token INTEGER,
    last_error    TEXT,
    due_at        REAL    NOT NULL,
    created_at    REAL    NOT NULL,
    done_at       REAL,
    claimed_until REAL,
    claimed_by    TEXT,
    trace         TEXT,
    PRIMARY KEY (instance_id, version, n)
);
-- No foreign key to the instances (as on PostgreSQL): every message is inserted by the commit
-- that just moved its instance, so the check would only cost a lookup per message.

-- Claiming walks a kind's pending messages in due order and stops after its limit; the next
-- due time is its first unclaimed one. The tail of the index orders the messages of one
-- commit, so the claim needs no sort. Partial: done messages cost the claim nothing.
CREATE INDEX flowlock_outbox_due ON flowlock_outbox (kind, due_at, instance_id, version, n)
    WHERE status = 'pending';
-- Per-instance order: a message may go only while no earlier one of its instance is pending.
-- Only pending rows, so the check never walks an instance's delivered past.
CREATE INDEX flowlock_outbox_order ON flowlock_outbox (instance_id, version, n)
    WHERE status = 'pending';
-- The claims held now (a few per dispatcher): the next due time counts when each runs out.
CREATE INDEX flowlock_outbox_claimed ON flowlock_outbox (claimed_until)
    WHERE claimed_until IS NOT NULL;
-- Retention deletes the oldest done messages in batches.
CREATE INDEX flowlock_outbox_done ON flowlock_outbox (done_at) WHERE status = 'done';
