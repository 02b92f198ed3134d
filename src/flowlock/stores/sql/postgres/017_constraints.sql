-- Constraints across instances (capacities, uniqueness, rate limits): the rows a commit's
-- claims change, in the commit's own transaction. See flowlock.stores.constraint_store.

-- One row per key: the holders now, the limit last used, the number of the key's last event.
-- Its row lock serializes the commits that count the key (held to commit).
CREATE TABLE flowlock_capacity (
    kind    text   NOT NULL,
    key     text   NOT NULL,
    holders int    NOT NULL CHECK (holders >= 0),
    lim     int    NOT NULL,
    seq     bigint NOT NULL,
    PRIMARY KEY (kind, key)
);

-- The slots held now: at most one per instance and kind. `seq`: the key's event that took it
-- (the holders are named oldest first). No foreign key: a purge frees the slot itself, so that
-- its counter goes down with it.
CREATE TABLE flowlock_slots (
    kind        text   NOT NULL,
    instance_id text   NOT NULL,
    key         text   NOT NULL,
    version     bigint NOT NULL,
    seq         bigint NOT NULL,
    PRIMARY KEY (kind, instance_id)
);
CREATE INDEX flowlock_slots_key ON flowlock_slots (kind, key, seq);

-- Every take (+1) and release (-1), numbered per key from 1, with the holders after it: what
-- `flowlock check` proves the limits from.
CREATE TABLE flowlock_slot_log (
    kind        text        NOT NULL,
    key         text        NOT NULL,
    seq         bigint      NOT NULL,
    instance_id text        NOT NULL,
    version     bigint      NOT NULL,
    delta       smallint    NOT NULL CHECK (delta IN (-1, 1)),
    holders     int         NOT NULL,
    lim         int         NOT NULL,
    at          timestamptz NOT NULL,
    PRIMARY KEY (kind, key, seq)
);

-- Every application counted against a rate limit, timed on the server's clock.
CREATE TABLE flowlock_rate_log (
    kind        text             NOT NULL,
    key         text             NOT NULL,
    at          timestamptz      NOT NULL,
    instance_id text             NOT NULL,
    version     bigint           NOT NULL,
    lim         int              NOT NULL,
    per         double precision NOT NULL
);
CREATE INDEX flowlock_rate_log_key ON flowlock_rate_log (kind, key, at);

-- A slot deleted (a release, a key that changed, a purge) wakes the engines waiting for one:
-- NOTIFY on the schema's channel, payload "kind<US>key<US>seq" (US: chr(31); seq: the event
-- that took the slot, so two slots of one key freed by one transaction are two notices, not
-- one folded by PostgreSQL's duplicate removal). Sent at commit: a rollback tells nobody.
CREATE FUNCTION flowlock_slots_notify() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_notify(
        'flowlock_slots.' || CASE WHEN octet_length(TG_TABLE_SCHEMA) <= 47
                                  THEN TG_TABLE_SCHEMA ELSE md5(TG_TABLE_SCHEMA) END,
        OLD.kind || chr(31) || OLD.key || chr(31) || OLD.seq);
    RETURN NULL;
END
$$;
CREATE TRIGGER flowlock_slots_freed AFTER DELETE ON flowlock_slots
    FOR EACH ROW EXECUTE FUNCTION flowlock_slots_notify();

-- Give back the slot `instance` holds of kind `k`, if any, by the commit of `version` `v`:
-- the slot row, the counter and the log in one statement. The key released, or NULL.
CREATE FUNCTION flowlock_release_slot(k text, instance text, v bigint) RETURNS text
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    held text;
BEGIN
    WITH gone AS (
        DELETE FROM flowlock_slots s WHERE s.kind = k AND s.instance_id = instance
        RETURNING s.key
    ), counted AS (
        UPDATE flowlock_capacity c SET holders = c.holders - 1, seq = c.seq + 1
          FROM gone g
         WHERE c.kind = k AND c.key = g.key
        RETURNING c.key, c.holders, c.lim, c.seq
    ), logged AS (
        INSERT INTO flowlock_slot_log (kind, key, seq, instance_id, version, delta, holders,
                                       lim, at)
        SELECT k, c.key, c.seq, instance, v, -1, c.holders, c.lim, clock_timestamp()
          FROM counted c
    )
    SELECT g.key INTO held FROM gone g;
    RETURN held;
END
$$;

-- A commit's claims (one element of each array per claim, in the order they apply), applied
-- for the instances of `moved` (those whose compare-and-swap won) only. A claim that does not
-- fit raises SQLSTATE FL028 with its facts as JSON in DETAIL: the whole statement, and so the
-- whole commit, rolls back. Several claims: every counter row they touch is locked first, in
-- (kind, key) order, so two commits that count the same keys cannot deadlock on them. Each
-- take or release is one statement (the counter, the slot and the log together). Returns how
-- many claims were applied.
CREATE FUNCTION flowlock_claims(
    moved text[], ids text[], versions bigint[], events text[], ops text[], kinds text[],
    keys text[], limits int[], pers double precision[], uniques boolean[]
) RETURNS int LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    claim record;
    applied int := 0;
    held text;
    counter record;
    t timestamptz;
    counted int;
    oldest timestamptz;
    names text[];
    rule text;
BEGIN
    IF moved IS NULL OR cardinality(moved) = 0 OR ids IS NULL THEN
        RETURN 0;
    END IF;
    -- Several claims: every counter row they touch is made (a new key's row, holding none)
    -- and locked first, in (kind, key) order. One claim locks one row (a take that gives back
    -- a slot of another key: two, locked in order below).
    IF cardinality(ids) > 1 THEN
        INSERT INTO flowlock_capacity AS c (kind, key, holders, lim, seq)
        SELECT DISTINCT ON (u.kind, u.key) u.kind, u.key, 0, u.lim, 0
          FROM unnest(ids, ops, kinds, keys, limits) AS u(id, op, kind, key, lim)
         WHERE u.op <> 'release' AND u.id = ANY(moved)
         ORDER BY u.kind, u.key
        ON CONFLICT (kind, key) DO NOTHING;
        PERFORM 1 FROM flowlock_capacity c
         WHERE (c.kind, c.key) IN (
                SELECT u.kind, u.key FROM unnest(ids, ops, kinds, keys) AS u(id, op, kind, key)
                 WHERE u.op <> 'release' AND u.id = ANY(moved)
                UNION
                SELECT s.kind, s.key FROM flowlock_slots s
                  JOIN unnest(ids, kinds) AS u(id, kind)
                    ON s.kind = u.kind AND s.instance_id = u.id
                 WHERE u.id = ANY(moved))
         ORDER BY c.kind, c.key
           FOR UPDATE OF c;
    END IF;
    -- A cursor over the claims (not subscripts: an element of an array of text is found by
    -- walking the array), those of instances not written left out.
    FOR claim IN
        SELECT u.* FROM unnest(ids, versions, events, ops, kinds, keys, limits, pers, uniques)
               WITH ORDINALITY AS u(id, version, event, op, kind, key, lim, per, uniq, n)
         WHERE u.id = ANY(moved)
         ORDER BY u.n
    LOOP
        applied := applied + 1;
        IF claim.op = 'release' THEN
            PERFORM flowlock_release_slot(claim.kind, claim.id, claim.version);
        ELSIF claim.op = 'take' THEN
            SELECT s.key INTO held FROM flowlock_slots s
             WHERE s.kind = claim.kind AND s.instance_id = claim.id;
            IF FOUND THEN
                CONTINUE WHEN held = claim.key;
                INSERT INTO flowlock_capacity (kind, key, holders, lim, seq)
                VALUES (claim.kind, claim.key, 0, claim.lim, 0)
                ON CONFLICT (kind, key) DO NOTHING;
                PERFORM 1 FROM flowlock_capacity c
                 WHERE c.kind = claim.kind AND c.key IN (held, claim.key)
                 ORDER BY c.key FOR UPDATE OF c;
                PERFORM flowlock_release_slot(claim.kind, claim.id, claim.version);
            END IF;
            -- The counter goes up only below the limit: ON CONFLICT locks the key's row and
            -- reads its newest version (a commit waiting here counts the one before it).
            WITH taken AS (
                INSERT INTO flowlock_capacity AS c (kind, key, holders, lim, seq)
                VALUES (claim.kind, claim.key, 1, claim.lim, 1)
                ON CONFLICT (kind, key) DO UPDATE
                   SET holders = c.holders + 1, lim = excluded.lim, seq = c.seq + 1
                 WHERE c.holders < excluded.lim
                RETURNING c.holders, c.seq
            ), slot AS (
                INSERT INTO flowlock_slots (kind, instance_id, key, version, seq)
                SELECT claim.kind, claim.id, claim.key, claim.version, taken.seq FROM taken
            ), logged AS (
                INSERT INTO flowlock_slot_log (kind, key, seq, instance_id, version, delta,
                                               holders, lim, at)
                SELECT claim.kind, claim.key, taken.seq, claim.id, claim.version, 1,
                       taken.holders, claim.lim, clock_timestamp()
                  FROM taken
            )
            SELECT taken.holders, taken.seq INTO counter FROM taken;
            IF NOT FOUND THEN
                SELECT coalesce(array_agg(s.instance_id ORDER BY s.seq), '{}') INTO names
                  FROM flowlock_slots s WHERE s.kind = claim.kind AND s.key = claim.key;
                rule := CASE WHEN claim.uniq THEN 'unique' ELSE 'capacity' END;
                RAISE EXCEPTION USING
                    ERRCODE = 'FL028',
                    MESSAGE = format('flowlock: %s %s of %s refused for instance %s',
                                     rule, claim.key, claim.kind, claim.id),
                    DETAIL = json_build_object(
                        'rule', rule, 'instance_id', claim.id, 'version', claim.version,
                        'event', claim.event, 'kind', claim.kind, 'key', claim.key,
                        'limit', claim.lim, 'holders', names)::text;
            END IF;
        ELSE
            -- A rate count: the key's counter row locked first, then the window read on the
            -- clock as it is once the lock is granted.
            INSERT INTO flowlock_capacity AS c (kind, key, holders, lim, seq)
            VALUES (claim.kind, claim.key, 0, claim.lim, 1)
            ON CONFLICT (kind, key) DO UPDATE SET lim = excluded.lim, seq = c.seq + 1;
            t := clock_timestamp();
            SELECT count(*) INTO counted FROM flowlock_rate_log r
             WHERE r.kind = claim.kind AND r.key = claim.key
               AND r.at > t - claim.per * interval '1 second';
            IF counted >= claim.lim THEN
                SELECT r.at INTO oldest FROM flowlock_rate_log r
                 WHERE r.kind = claim.kind AND r.key = claim.key
                   AND r.at > t - claim.per * interval '1 second'
                 ORDER BY r.at OFFSET counted - claim.lim LIMIT 1;
                RAISE EXCEPTION USING
                    ERRCODE = 'FL028',
                    MESSAGE = format('flowlock: rate %s of %s refused for instance %s',
                                     claim.key, claim.kind, claim.id),
                    DETAIL = json_build_object(
                        'rule', 'rate', 'instance_id', claim.id, 'version', claim.version,
                        'event', claim.event, 'kind', claim.kind, 'key', claim.key,
                        'limit', claim.lim, 'per', claim.per,
                        'retry_after', greatest(0, extract(epoch FROM
                            oldest + claim.per * interval '1 second' - t)))::text;
            END IF;
            INSERT INTO flowlock_rate_log (kind, key, at, instance_id, version, lim, per)
            VALUES (claim.kind, claim.key, t, claim.id, claim.version, claim.lim, claim.per);
        END IF;
    END LOOP;
    RETURN applied;
END
$$;

-- Retention: the slots the purged instances `gone` still hold (a capacity on a final state)
-- are released, as their last version (`versions`, by place in `ids`). The kinds are found by
-- a walk of the counters' primary key (one probe per kind), so each kind's slots are reached
-- through flowlock_slots' primary key.
CREATE FUNCTION flowlock_free_slots(gone text[], ids text[], versions bigint[]) RETURNS int
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    slot record;
    freed int := 0;
BEGIN
    IF gone IS NULL OR cardinality(gone) = 0 THEN
        RETURN 0;
    END IF;
    FOR slot IN
        WITH RECURSIVE kinds AS (
            (SELECT kind FROM flowlock_capacity ORDER BY kind LIMIT 1)
            UNION ALL
            SELECT (SELECT c.kind FROM flowlock_capacity c WHERE c.kind > k.kind
                     ORDER BY c.kind LIMIT 1)
              FROM kinds k WHERE k.kind IS NOT NULL
        )
        SELECT s.kind, s.instance_id FROM kinds k
          JOIN flowlock_slots s ON s.kind = k.kind AND s.instance_id = ANY(gone)
         ORDER BY s.kind, s.key
    LOOP
        PERFORM flowlock_release_slot(slot.kind, slot.instance_id,
                                      versions[array_position(ids, slot.instance_id)]);
        freed := freed + 1;
    END LOOP;
    RETURN freed;
END
$$;
