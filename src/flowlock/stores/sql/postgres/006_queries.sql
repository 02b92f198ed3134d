-- Queries (Engine.list / Engine.count), in id order by code point (COLLATE "C", whatever the
-- database's collation; the primary key's index is in the database's collation, so it cannot
-- give that order unless the database's collation is "C").
-- By workflow and state ("which approvals are pending?"): one index range per (workflow, state),
-- already in id order, so a page reads only its own rows; counts are index-only scans.
CREATE INDEX IF NOT EXISTS flowlock_instances_by_state
    ON flowlock_instances (workflow, state, id COLLATE "C");
-- Queries without a workflow walk this one. id never changes, so it costs an index entry per
-- created instance and nothing per transition (updates stay HOT when the state does not change).
CREATE INDEX IF NOT EXISTS flowlock_instances_by_id ON flowlock_instances (id COLLATE "C");
-- updated_at is deliberately not indexed: every transition changes it, so an index on it would
-- make every update of the hot rows a non-HOT update that writes every index, for the sake of an
-- occasional query. The updated_before / updated_after filters narrow the rows the indexes above
-- find. IF NOT EXISTS: on a large table, an operator may build these beforehand with
-- CREATE INDEX CONCURRENTLY (same names) so that migrating does not hold up writes.
