-- An operator's pauses (engine.pause). An instance's own pause is a column, set by the
-- compare-and-swap that writes its pause or resume history row; a whole workflow's pause is one
-- row here, however many instances the workflow has, read with each instance by every read that
-- feeds a decision (an EXISTS on the primary key). Adding a column with a constant default
-- rewrites no row (PostgreSQL 11 and later).
ALTER TABLE flowlock_instances ADD COLUMN paused boolean NOT NULL DEFAULT false;

CREATE TABLE flowlock_workflow_pauses (
    workflow text PRIMARY KEY,
    reason   text NOT NULL,
    actor    text,
    at       timestamptz NOT NULL DEFAULT now()
);
