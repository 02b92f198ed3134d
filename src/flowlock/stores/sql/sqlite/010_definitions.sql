-- Versioned workflow definitions (see the PostgreSQL migration): one row per (workflow,
-- version); the same hash is always the same version. `definition` is JSON text, `created_at`
-- ISO-8601 UTC text, as elsewhere.
CREATE TABLE flowlock_definitions (
    workflow   TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    hash       TEXT    NOT NULL,
    definition TEXT    NOT NULL,
    created_at TEXT    NOT NULL,
    PRIMARY KEY (workflow, version),
    UNIQUE (workflow, hash)
);
-- The version each instance runs (its last history row's) and the one each row was decided with
-- (NULL: written before versions existed).
ALTER TABLE flowlock_instances ADD COLUMN definition_version INTEGER;
ALTER TABLE flowlock_history ADD COLUMN definition_version INTEGER;
