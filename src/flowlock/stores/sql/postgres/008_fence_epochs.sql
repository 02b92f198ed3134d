-- Fencing epochs of the Redis lock backend (flowlock.locks.redis): one row per (namespace, key)
-- whose Redis fencing counter has ever been started. Each time an acquirer finds the counter
-- missing (a new key, or Redis lost its data), the epoch is bumped and committed before the
-- counter is started at epoch * 2^32 in Redis: tokens of a later epoch are above every token of
-- an earlier one, however many times Redis loses its data. A row is never deleted (a key whose
-- epoch went back to 0 could repeat its tokens).
CREATE TABLE flowlock_fence_epochs (
    namespace text   NOT NULL,
    key       text   NOT NULL,
    epoch     bigint NOT NULL CHECK (epoch >= 1),
    PRIMARY KEY (namespace, key)
);
