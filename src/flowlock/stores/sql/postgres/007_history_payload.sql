-- The payload of the call that applied each transition (an approver's comment, say), kept whether
-- or not an effect copied it into the data. A retry under the same request_id must carry the same
-- payload (else IdempotencyKeyReused). Rows written before this migration get the empty object.
ALTER TABLE flowlock_history ADD COLUMN payload jsonb NOT NULL DEFAULT '{}'::jsonb;
