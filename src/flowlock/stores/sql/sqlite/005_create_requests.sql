-- The idempotency keys of creates (see the PostgreSQL migration): one row per key, written in the
-- transaction that inserts the instance, with the state and data the instance was created with.
CREATE TABLE flowlock_create_requests (
    request_id  TEXT PRIMARY KEY NOT NULL,
    instance_id TEXT NOT NULL UNIQUE REFERENCES flowlock_instances (id),
    state       TEXT NOT NULL,
    data        TEXT NOT NULL
);
