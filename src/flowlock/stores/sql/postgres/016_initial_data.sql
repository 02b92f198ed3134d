-- The instance's data as its create made it, written once by the create's own INSERT and never
-- updated, so `engine.check_definition` can replay an instance's first transition. Instances
-- created before this migration keep NULL: replay starts them from their first history row.
-- A nullable column without a default: adding it rewrites nothing, whatever the table's size.
ALTER TABLE flowlock_instances ADD COLUMN IF NOT EXISTS initial_data jsonb;
