-- The transactional outbox. A transition's messages are written by the statement of its
-- compare-and-swap, joined to the instances that statement moved: a lost compare-and-swap
-- writes none, a rolled-back transaction leaves none. Message n (from 0) of the entry that
-- took an instance to `version` has the key <instance_id>:<version>:<n>, unique forever.
-- The key is not a column: it is the primary key written out, and a stored copy with its own
-- unique index made each message's insert about twice as dear (measured). COLLATE "C": the
-- primary key lists messages in code point order of their instance, as every store lists them.
CREATE TABLE flowlock_outbox (
    instance_id   text COLLATE "C" NOT NULL,
    version       bigint      NOT NULL,
    n             integer     NOT NULL CHECK (n >= 0),
    -- The instance's workflow and the handler's name.
    workflow      text        NOT NULL,
    kind          text        NOT NULL,
    payload       jsonb       NOT NULL,
    -- Stored: pending (to deliver, or delivering while a claim runs), done, dead (given up).
    status        text        NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'done', 'dead')),
    -- Deliveries begun so far; a claim counts one up.
    attempts      integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- The lease's token when the distributed strategy wrote the transition.
    fencing_token bigint,
    last_error    text,
    -- On the database server's clock, never a host's: due now at the commit, later after a
    -- failed delivery.
    due_at        timestamptz NOT NULL DEFAULT now(),
    created_at    timestamptz NOT NULL DEFAULT now(),
    done_at       timestamptz,
    -- The claim of the dispatcher delivering it now: until when (a lease), and by whom.
    claimed_until timestamptz,
    claimed_by    text,
    -- The W3C traceparent of the call that emitted it.
    trace         text,
    PRIMARY KEY (instance_id, version, n)
);
-- No foreign key to the instances: a message's insert would then look its instance up again
-- (a row lock check per message), on the hot path, for a row the same statement just wrote.

-- Claiming: the pending messages of a kind, in due order. Partial, so done messages (kept
-- until retention deletes them) cost the claim nothing.
CREATE INDEX flowlock_outbox_due ON flowlock_outbox (kind, due_at) WHERE status = 'pending';
-- Order per instance: a message is claimable only while no earlier one of its instance is
-- pending. One probe of this small index per candidate.
CREATE INDEX flowlock_outbox_order ON flowlock_outbox (instance_id, version, n)
    WHERE status = 'pending';
-- Retention: the done messages, oldest first.
CREATE INDEX flowlock_outbox_done ON flowlock_outbox (done_at) WHERE status = 'done';

-- Dispatchers LISTEN on the channel of their schema; a commit that writes messages wakes them
-- (NOTIFY is sent at commit: a rollback notifies nothing). One notification per transaction:
-- a statement-level trigger, the same channel and empty payload each time, which PostgreSQL
-- sends once however often the transaction notifies. A statement that inserted nothing (its
-- compare-and-swap lost) sends none. The channel names the schema, as the timers' does (md5
-- of a name too long for a channel). search_path FROM CURRENT: the function resolves names in
-- the schema it was made in, whatever the committer's search_path.
CREATE FUNCTION flowlock_outbox_notify() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
BEGIN
    IF EXISTS (SELECT FROM written) THEN
        PERFORM pg_notify(
            'flowlock_outbox.' || CASE WHEN octet_length(TG_TABLE_SCHEMA) <= 47
                                       THEN TG_TABLE_SCHEMA ELSE md5(TG_TABLE_SCHEMA) END,
            '');
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER flowlock_outbox_written AFTER INSERT ON flowlock_outbox
    REFERENCING NEW TABLE AS written
    FOR EACH STATEMENT EXECUTE FUNCTION flowlock_outbox_notify();

-- The same notification, for a statement that makes a message claimable by an update (an
-- operator's retry): the schema is the one this function finds the table in.
CREATE FUNCTION flowlock_outbox_wake() RETURNS void LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
DECLARE
    found text := (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE c.oid = to_regclass('flowlock_outbox'));
BEGIN
    PERFORM pg_notify(
        'flowlock_outbox.' || CASE WHEN octet_length(found) <= 47 THEN found ELSE md5(found) END,
        '');
END
$$;
