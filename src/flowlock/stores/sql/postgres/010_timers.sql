-- Durable timers (timed transitions). A timer belongs to one stay of an instance in a state:
-- the version at which the instance entered that state. The commit that enters a state arms its
-- timers, the commit that leaves it deletes them, and the commit of a firing moves a reminder on
-- or deletes it: each in the same statement as the instance's compare-and-swap.

-- The version of the entry that last changed the state (1 after the create). NULL: the instance
-- entered its state before this migration, so no timer belongs to its stay; its next change of
-- state sets it. Added with no default and no backfill, so the table is not rewritten (a
-- constant default would stamp 1 on the rows already there; an UPDATE would rewrite them all).
-- The default is set afterwards, for rows inserted from then on by an INSERT that does not name
-- the column (1: a create begins the first stay); that changes no existing row.
ALTER TABLE flowlock_instances ADD COLUMN stay_version bigint;
ALTER TABLE flowlock_instances ALTER COLUMN stay_version SET DEFAULT 1;

CREATE TABLE flowlock_timers (
    instance_id   text             NOT NULL REFERENCES flowlock_instances (id) ON DELETE CASCADE,
    -- The stay that armed it: a stay's version is new, so arming never meets an older row.
    stay          bigint           NOT NULL,
    event         text             NOT NULL,
    -- The instance's workflow, so an engine claims only the timers of workflows it runs.
    workflow      text             NOT NULL,
    -- On the database server's clock (now() of the arming transaction + after), never a host's.
    due_at        timestamptz      NOT NULL,
    -- Firings done so far; a firing's request id is timer:<stay>:<event>:<n>.
    n             bigint           NOT NULL DEFAULT 0 CHECK (n >= 0),
    -- A reminder's period in seconds (NULL: fires once), and its most firings (NULL: no limit).
    every         double precision CHECK (every > 0),
    lim           bigint           CHECK (lim >= 1),
    -- The claim of the engine firing it now: none, or until when (a lease), and by whom.
    claimed_until timestamptz,
    claimed_by    text,
    PRIMARY KEY (instance_id, stay, event)
);
-- Claiming: the due timers of the workflows an engine runs, earliest first.
CREATE INDEX flowlock_timers_due ON flowlock_timers (workflow, due_at);

-- The timer services of every engine LISTEN on the channel of their schema. A commit that arms
-- the earliest timer of its workflow wakes them (NOTIFY is sent at commit: a rollback notifies
-- nothing), with its due time as the payload (seconds since the epoch). A commit that arms a
-- timer due after another of its workflow, unclaimed and due more than a second from now, sends
-- nothing: every service running that workflow already wakes by then and looks again. Why this
-- matters: PostgreSQL serializes the commits that notify (their WAL flushes included), which
-- cut the creates of a timed workflow to a third. Checked at commit (a deferred trigger), so
-- the earlier timer it counts on is still armed when this commit becomes visible. Timers due
-- together (one commit's, or two commits') are ordered by key, so one of them always notifies
-- unless an earlier one is armed. The channel
-- names the schema, so engines on two schemas of one database do not wake each other; a schema
-- name too long for a channel name (63 bytes) is replaced by its md5. The function reads the
-- timers of the schema it was made in (search_path FROM CURRENT), whatever the committer's is.
CREATE FUNCTION flowlock_timers_notify() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
DECLARE
    -- Computed once: a bound the query can read the due index from (clock_timestamp() in the
    -- query itself is volatile, so it would filter row by row instead).
    soon timestamptz := clock_timestamp() + interval '1 second';
BEGIN
    IF NOT EXISTS (
        SELECT FROM flowlock_timers t
         WHERE t.workflow = NEW.workflow
           AND t.due_at > soon
           AND t.due_at <= NEW.due_at
           AND (t.due_at, t.instance_id, t.stay, t.event)
               < (NEW.due_at, NEW.instance_id, NEW.stay, NEW.event)
           AND (t.claimed_until IS NULL OR t.claimed_until <= clock_timestamp())
    ) THEN
        PERFORM pg_notify(
            'flowlock_timers.' || CASE WHEN octet_length(TG_TABLE_SCHEMA) <= 47
                                       THEN TG_TABLE_SCHEMA ELSE md5(TG_TABLE_SCHEMA) END,
            extract(epoch FROM NEW.due_at)::text);
    END IF;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER flowlock_timers_armed AFTER INSERT ON flowlock_timers
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION flowlock_timers_notify();
