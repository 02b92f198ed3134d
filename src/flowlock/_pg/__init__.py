"""PostgreSQL plumbing shared by the PostgreSQL adapters (the store, the advisory locks, the
run-once jobs) and the benchmark, so that none of them imports another:

- `pool`: the one pool factory (schema, search_path, application name, reset,
  the jsonb codec);
- `pooling`: whether a pooler (PgBouncer) sits in front, and which kind: the probe on open;
- `errors`: the one translation of driver errors into flowlock errors;
- `migrations`: the migration runner, under a transaction-level advisory lock;
- `rows`: rows to Instance / HistoryEntry, and bulk reads.

Private: the public API is the adapters.
"""

from flowlock.core.extras import require

require("asyncpg", "postgres", "PostgreSQL support")
