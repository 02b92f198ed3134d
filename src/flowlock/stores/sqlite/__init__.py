"""The SQLite store: stdlib `sqlite3`, one thread per connection, WAL.

- `sql`: statement texts, query builders, value encoding;
- `txn`: the transactions, each run whole on a connection's thread;
- `timers`, `outbox_sql`: the timers' and the outbox's statements and transactions;
- `timer_methods`, `outbox`: the TimerStore and OutboxStore methods, mixins of the store
  (`part`: what they use of it);
- `pool`: the connections and their threads;
- `store`: [`SqliteStore`][flowlock.stores.sqlite.SqliteStore], which composes them.
"""

from __future__ import annotations

from flowlock.stores.sqlite.sql import count_statement, list_statement
from flowlock.stores.sqlite.store import SqliteStore

__all__ = ["SqliteStore", "count_statement", "list_statement"]
