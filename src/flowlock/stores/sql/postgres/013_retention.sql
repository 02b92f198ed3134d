-- Retention's legal holds: an instance named here is never purged. One row per instance id,
-- which need not exist (a hold may be placed before a restore, or outlive a purge elsewhere):
-- so no foreign key. The purge's delete checks this table in the statement that deletes.
CREATE TABLE flowlock_holds (
    instance_id text        PRIMARY KEY,
    reason      text,
    actor       text,
    at          timestamptz NOT NULL DEFAULT now()
);
-- A purge walks one workflow's instances in id order (code point order, as list_instances);
-- flowlock_instances_by_state already serves that walk per state. updated_at stays unindexed
-- (see 006_queries.sql): the age bound filters the rows that walk finds.
