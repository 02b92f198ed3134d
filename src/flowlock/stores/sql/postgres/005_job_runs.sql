-- Scheduled-job runs of flowlock.runner.RunOnce: one row per (job, tick), so a tick runs to
-- completion at most once, even after a lease expired or a runner died.
CREATE TABLE flowlock_job_runs (
    job         text        NOT NULL,
    tick        text        NOT NULL,
    -- running -> done; running -> failed (fn raised) -> running again (a later runner retries).
    state       text        NOT NULL CHECK (state IN ('running', 'done', 'failed')),
    -- The lease's fencing token of the runner that owns the row. A takeover needs a higher one,
    -- and completion is `... WHERE fencing = mine`: a runner that lost its lease cannot finish.
    fencing     bigint      NOT NULL,
    owner       text        NOT NULL,
    attempts    integer     NOT NULL DEFAULT 1,
    error       text,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    PRIMARY KEY (job, tick)
);
