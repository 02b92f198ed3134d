-- Versioned workflow definitions (flowlock.core.versions): one row per (workflow, version), the
-- version numbered from 1 per workflow. The same content hash is always the same version: the
-- unique (workflow, hash) makes a concurrent register of one definition in many processes give
-- one version, and the primary key makes two different new definitions take different numbers
-- (the loser of either race reads, or retries with the next number).
CREATE TABLE flowlock_definitions (
    workflow   text        NOT NULL,
    version    integer     NOT NULL,
    hash       text        NOT NULL,
    definition jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow, version),
    UNIQUE (workflow, hash)
);
-- The version each instance runs (its last history row's) and the one each row was decided with.
-- NULL: written before versions existed; such an instance runs the newest registered version.
-- Nullable without a default: adding them rewrites nothing. Unindexed: only the
-- `flowlock definitions` counts read them, and a transition that keeps the version stays HOT.
ALTER TABLE flowlock_instances ADD COLUMN definition_version integer;
ALTER TABLE flowlock_history ADD COLUMN definition_version integer;
