-- The idempotency keys of creates (Engine.create(request_id=...), POST /instances with an
-- Idempotency-Key): one row per key, inserted by the statement that inserts the instance, with the
-- state and data the instance was created with. A retry under the key answers that first create
-- exactly (version 1), however far the instance has moved since. A key names one instance and an
-- instance has at most one key; the workflow and created_at are the instance's own (they never
-- change). A second create under a key still being inserted waits for it, then finds it.
CREATE TABLE flowlock_create_requests (
    request_id  text  PRIMARY KEY,
    instance_id text  NOT NULL UNIQUE REFERENCES flowlock_instances (id),
    state       text  NOT NULL,
    data        jsonb NOT NULL
);
