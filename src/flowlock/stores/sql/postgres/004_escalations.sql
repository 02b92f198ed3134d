-- The adaptive strategy's escalations, shared by every engine on this database: an engine that
-- escalates an instance writes it here, and the others adopt it within about a second.
CREATE TABLE flowlock_escalations (
    key       text        PRIMARY KEY,
    strategy  text        NOT NULL,
    until     timestamptz NOT NULL,
    reason    text        NOT NULL
);
CREATE INDEX flowlock_escalations_until ON flowlock_escalations (until);
