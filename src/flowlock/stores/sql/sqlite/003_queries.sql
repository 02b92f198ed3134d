-- Queries (Engine.list / Engine.count): the instances of a workflow in a state, in id order,
-- without reading the others ("which approvals are pending?"). The primary key serves the
-- queries without a workflow. updated_at is not indexed: every transition changes it, so such an
-- index would be rewritten on every write for the sake of an occasional query.
CREATE INDEX flowlock_instances_by_state ON flowlock_instances (workflow, state, id);
