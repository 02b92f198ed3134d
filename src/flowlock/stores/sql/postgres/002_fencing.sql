-- Fencing tokens from the distributed strategy's leases. A write under a lease records its token;
-- the compare-and-swap refuses a token lower than the last one written, so a holder whose lease
-- was lost (paused past its ttl, or a Redis failover) cannot write after a newer holder did.
ALTER TABLE flowlock_instances ADD COLUMN fencing_token bigint;
ALTER TABLE flowlock_history ADD COLUMN fencing_token bigint;
