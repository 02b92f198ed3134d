-- The payload of the call that applied each transition, as JSON text (see the PostgreSQL
-- migration). Rows written before this migration get the empty object.
ALTER TABLE flowlock_history ADD COLUMN payload TEXT NOT NULL DEFAULT '{}';
