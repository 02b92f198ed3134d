"""The SQL of the timers section: bulk arming, and reading the firings back.

Arming 100,000 timers through `engine.create` would take longer than the measurement, so
`ARM` writes them in one statement, exactly as the PostgreSQL store's create would for
the lag workflow (the same columns and values), except that each instance is stamped as
created `after` seconds before its timer falls due. A test holds it to the store's own rows.
"""

from __future__ import annotations

from flowlock._pg.rows import TIMER_COLUMNS

__all__ = [
    "ACTIVITY",
    "ARM",
    "CLOCK",
    "CREATE_DATABASE",
    "DROP_DATABASE",
    "FIRED",
    "LAGS",
    "NOW",
    "TABLE_SCANS",
    "TIMERS_OF",
    "VACUUM",
]

NOW = "SELECT extract(epoch FROM now())::float8"

# $1 id prefix, $2 how many, $3 seconds from now() to the first due time, $4 timers due per
# second, $5 workflow, $6 its expiry's `after` in seconds. Instance i falls due at
# now() + $3 + i / $4. What the store's create writes (flowlock_instances: version 1, stay 1,
# empty data and initial data, the newest stored definition version, created_at = updated_at;
# flowlock_timers: stay 1, firing 0, unclaimed, due at created_at + after), with created_at set
# back by `after` from the due time.
ARM = """
WITH due AS (
    SELECT $1::text || i AS id,
           now() + ($3::float8 + i / $4::float8) * interval '1 second' AS due_at
      FROM generate_series(0, $2::int - 1) AS i
), made AS (
    INSERT INTO flowlock_instances
           (id, workflow, state, version, data, created_at, updated_at, stay_version,
            initial_data, definition_version)
    SELECT id, $5::text, 'pending', 1, '{}'::jsonb,
           due_at - $6::float8 * interval '1 second', due_at - $6::float8 * interval '1 second', 1,
           '{}'::jsonb,
           (SELECT max(version) FROM flowlock_definitions WHERE workflow = $5::text)
      FROM due
    RETURNING id, workflow, created_at
)
INSERT INTO flowlock_timers (instance_id, stay, event, workflow, due_at, every, lim)
SELECT id, 1, 'expire', workflow, created_at + $6::float8 * interval '1 second', NULL, NULL
  FROM made
"""

# Every instance of the workflow $1 due in [$3, $4) (epoch seconds), with the lag of its
# firing: its history row's `at` minus its due time (created_at + $2 seconds); NULL when it
# has not fired.
LAGS = """
SELECT extract(epoch FROM h.at - (i.created_at + $2::float8 * interval '1 second'))::float8
       AS lag
  FROM flowlock_instances i
  LEFT JOIN flowlock_history h ON h.instance_id = i.id
 WHERE i.workflow = $1
   AND i.created_at + $2::float8 * interval '1 second' >= to_timestamp($3::float8)
   AND i.created_at + $2::float8 * interval '1 second' < to_timestamp($4::float8)
"""
# The instances of workflow $1 something was applied to.
FIRED = "SELECT id FROM flowlock_instances WHERE workflow = $1 AND version > 1"
# The armed timers of the instances $1, as the store reads them.
TIMERS_OF = f"SELECT {TIMER_COLUMNS} FROM flowlock_timers WHERE instance_id = ANY($1::text[])"
# Every table of the database, the system catalogs too: a database just created (and migrated)
# is otherwise visited by autovacuum within the minute, while the engine is being measured.
VACUUM = "VACUUM (ANALYZE)"

# The idle cost: a database of its own, created and dropped from the run's database.
CREATE_DATABASE = 'CREATE DATABASE "{name}"'
DROP_DATABASE = 'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
# Sequential and index scans of each of flowlock's tables in the connection's database.
TABLE_SCANS = """
SELECT relname::text AS name, (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::bigint AS scans
  FROM pg_stat_user_tables WHERE relname LIKE 'flowlock%'
"""
# Every backend in database $1 and the statement it runs or ran last, with when it started
# (server clock, epoch seconds): a statement is one (pid, started) pair.
ACTIVITY = """
SELECT pid, backend_type::text AS kind, application_name AS app,
       extract(epoch FROM query_start)::float8 AS started, left(query, 300) AS query
  FROM pg_stat_activity WHERE datname = $1
"""
CLOCK = "SELECT extract(epoch FROM clock_timestamp())::float8"
