-- An operator's pauses (engine.pause). An instance's own pause is a column, set by the commit
-- of its pause or resume history row; a whole workflow's pause is one row here, however many
-- instances the workflow has, read with each instance (an EXISTS on the primary key).
-- `at` is ISO-8601 UTC text, as the instances' timestamps.
ALTER TABLE flowlock_instances ADD COLUMN paused INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1));

CREATE TABLE flowlock_workflow_pauses (
    workflow TEXT PRIMARY KEY,
    reason   TEXT NOT NULL,
    actor    TEXT,
    at       TEXT NOT NULL
);
