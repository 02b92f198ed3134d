-- Fencing tokens of the PostgreSQL advisory-lock backend (flowlock.locks.advisory): the highest
-- token handed out per (namespace, key). Each increment is committed, while the key's advisory
-- lock is held, before its token is handed out: a token is never handed out twice, not even
-- after its holder died, and the counter survives restarts of the server and of the clients.
CREATE TABLE flowlock_fences (
    namespace text   NOT NULL,
    key       text   NOT NULL,
    token     bigint NOT NULL CHECK (token >= 1),
    PRIMARY KEY (namespace, key)
-- Every acquire updates its row; token is not indexed, so with free room on the page the update
-- is HOT (no index write, the old version pruned in place).
) WITH (fillfactor = 50);
