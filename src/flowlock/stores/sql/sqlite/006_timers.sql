-- Durable timers. A stay is the version at which the instance entered its state (1 at create);
-- timers belong to one stay. NULL: the instance entered its state before this migration, so no
-- timer belongs to its stay; its next change of state sets it. No default and no backfill, so
-- no row is rewritten (SQLite would show a default on every existing row, and cannot add one
-- later): every INSERT of the store names the column.
ALTER TABLE flowlock_instances ADD COLUMN stay_version INTEGER;

-- One row per armed timer, written in the transaction of the commit that arms, fires or voids
-- it. SQLite has no server clock: due_at and claimed_until are epoch seconds on the wall clock
-- of the host that wrote them (every process sharing the file runs on that host).
-- lim, not limit: LIMIT is a keyword.
CREATE TABLE flowlock_timers (
    instance_id   TEXT    NOT NULL REFERENCES flowlock_instances (id) ON DELETE CASCADE,
    stay          INTEGER NOT NULL,
    event         TEXT    NOT NULL,
    workflow      TEXT    NOT NULL,
    due_at        REAL    NOT NULL,
    n             INTEGER NOT NULL DEFAULT 0 CHECK (n >= 0),
    every         REAL,
    lim           INTEGER,
    claimed_until REAL,
    claimed_by    TEXT,
    PRIMARY KEY (instance_id, stay, event)
);
-- Claiming and the next due time walk the timers in due order and stop at the first that fits.
CREATE INDEX flowlock_timers_by_due ON flowlock_timers (due_at);
-- The claims held now (a few per engine): the next due time counts when each runs out.
CREATE INDEX flowlock_timers_claimed ON flowlock_timers (claimed_until)
    WHERE claimed_until IS NOT NULL;
