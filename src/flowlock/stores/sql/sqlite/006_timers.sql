-- Durable timers. A stay is the version at which the instance entered its state (1 at create);
-- timers belong to one stay. Rows written before this migration take their version as their
-- stay: when they entered their state is not known, and none of them has a timer armed.
ALTER TABLE flowlock_instances ADD COLUMN stay_version INTEGER NOT NULL DEFAULT 1;
UPDATE flowlock_instances SET stay_version = version;

-- One row per armed timer, written in the transaction of the commit that arms, fires or voids
-- it. SQLite has no server clock: due_at and claimed_until are epoch seconds on the wall clock
-- of the host that wrote them (every process sharing the file runs on that host).
-- lim, not limit: LIMIT is a keyword.
CREATE TABLE flowlock_timers (
    instance_id   TEXT    NOT NULL REFERENCES flowlock_instances (id),
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
