"""The SQLite store: stdlib :mod:`sqlite3`, one thread per connection, WAL.

- :mod:`~flowlock.stores.sqlite.sql`: statement texts, query builders, value encoding;
- :mod:`~flowlock.stores.sqlite.txn`: the transactions, each run whole on a connection's thread;
- :mod:`~flowlock.stores.sqlite.pool`: the connections and their threads;
- :mod:`~flowlock.stores.sqlite.store`: :class:`SqliteStore`, which composes them.
"""

from __future__ import annotations

from flowlock.stores.sqlite.sql import count_statement, list_statement
from flowlock.stores.sqlite.store import SqliteStore

__all__ = ["SqliteStore", "count_statement", "list_statement"]
