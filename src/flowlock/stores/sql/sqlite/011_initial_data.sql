-- The instance's data as its create made it (JSON text), written once by the create's INSERT
-- and never updated, so `engine.check_definition` can replay an instance's first transition.
-- Instances created before this migration keep NULL: replay starts them from their first row.
ALTER TABLE flowlock_instances ADD COLUMN initial_data TEXT;
