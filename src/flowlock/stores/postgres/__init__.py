"""The PostgreSQL store on asyncpg, one concern per module.

- `sql`: the statement texts, query builders and arguments;
- `session`: where a call's statements run (flowlock's pool, an
  application's pool, a caller's transaction) and how driver errors read there;
- `operations`: the statements of one call;
- `pipeline`: calls on different instances sharing a round trip;
- `timer_sql`: what a commit does to timers, and the timer service's statements;
- `timers`: the timer methods and the LISTEN that wakes the timer service;
- `outbox_sql`: what a commit writes to the outbox, and the dispatcher's statements;
- `outbox`: the outbox methods and the LISTEN that wakes the dispatcher;
- `listen`: the LISTEN loop both share (a connection of its own, opened again when it drops);
- `store`: [`PostgresStore`][flowlock.stores.postgres.PostgresStore], which composes them.
"""

from __future__ import annotations

from flowlock.core.extras import require

require("asyncpg", "postgres", "The PostgreSQL store (flowlock.stores.postgres)")

from flowlock.stores.postgres.sql import count_statement, list_statement
from flowlock.stores.postgres.store import PostgresStore

__all__ = ["PostgresStore", "count_statement", "list_statement"]
