-- flowlock schema, version 1. Applied once, inside the migration transaction.
CREATE TABLE flowlock_instances (
    id          text        PRIMARY KEY,
    workflow    text        NOT NULL,
    state       text        NOT NULL,
    -- Every write is `... WHERE id = $1 AND version = $2`: the version is the compare-and-swap.
    version     bigint      NOT NULL CHECK (version >= 1),
    data        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    last_event  text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE flowlock_history (
    instance_id text        NOT NULL REFERENCES flowlock_instances (id),
    version     bigint      NOT NULL,
    event       text        NOT NULL,
    from_state  text        NOT NULL,
    to_state    text        NOT NULL,
    actor       text,
    request_id  text,
    strategy    text        NOT NULL,
    data        jsonb       NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    -- One row per version: a second writer of the same version cannot commit.
    PRIMARY KEY (instance_id, version),
    -- Exactly once per request: a repeated request id cannot be applied twice.
    CONSTRAINT flowlock_history_request_uniq UNIQUE (instance_id, request_id)
);
