-- Retention's legal holds (see the PostgreSQL migration): an instance named here is never
-- purged. The id need not exist, so no foreign key. `at` is ISO-8601 UTC text, as elsewhere.
CREATE TABLE flowlock_holds (
    instance_id TEXT PRIMARY KEY NOT NULL,
    reason      TEXT,
    actor       TEXT,
    at          TEXT NOT NULL
);
