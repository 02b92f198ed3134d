-- flowlock schema, version 1 (SQLite). Same shape as the PostgreSQL schema; data is JSON text,
-- timestamps are ISO-8601 UTC text.
CREATE TABLE flowlock_instances (
    id          TEXT    PRIMARY KEY NOT NULL,
    workflow    TEXT    NOT NULL,
    state       TEXT    NOT NULL,
    version     INTEGER NOT NULL CHECK (version >= 1),
    data        TEXT    NOT NULL DEFAULT '{}',
    last_event  TEXT,
    created_at  TEXT    NOT NULL,
    updated_at  TEXT    NOT NULL
);

CREATE TABLE flowlock_history (
    instance_id TEXT    NOT NULL REFERENCES flowlock_instances (id),
    version     INTEGER NOT NULL,
    event       TEXT    NOT NULL,
    from_state  TEXT    NOT NULL,
    to_state    TEXT    NOT NULL,
    actor       TEXT,
    request_id  TEXT,
    strategy    TEXT    NOT NULL,
    data        TEXT    NOT NULL,
    at          TEXT    NOT NULL,
    PRIMARY KEY (instance_id, version),
    UNIQUE (instance_id, request_id)
);
