-- Fencing tokens from the distributed strategy's leases (see the PostgreSQL migration).
ALTER TABLE flowlock_instances ADD COLUMN fencing_token INTEGER;
ALTER TABLE flowlock_history ADD COLUMN fencing_token INTEGER;
