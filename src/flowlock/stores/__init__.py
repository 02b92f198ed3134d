"""Stores: where instances and their history live. See :mod:`flowlock.stores.base`."""

from __future__ import annotations

from flowlock.errors import InvalidInput
from flowlock.stores.base import EscalationBoard, LockedResult, Plan, RowLock, Store
from flowlock.stores.memory import MemoryBoard, MemoryStore

__all__ = [
    "EscalationBoard",
    "LockedResult",
    "MemoryBoard",
    "MemoryStore",
    "Plan",
    "RowLock",
    "Store",
    "store_from_url",
]


def store_from_url(
    url: str, *, auto_migrate: bool = True, pool_size: int = 20, schema: str | None = None
) -> Store:
    """The store for ``url``: ``postgresql://`` / ``postgres://`` (asyncpg), ``sqlite:///path``,
    or ``memory://`` (in-process, for tests)."""
    if not isinstance(url, str):
        raise InvalidInput(f"database_url must be a string, not {type(url).__name__}")
    scheme = url.partition("://")[0].lower()
    if scheme in ("postgresql", "postgres"):
        from flowlock.stores.postgres import PostgresStore

        return PostgresStore(url, pool_size=pool_size, schema=schema, auto_migrate=auto_migrate)
    if scheme == "sqlite":
        from flowlock.stores.sqlite import SqliteStore

        return SqliteStore.from_url(url, auto_migrate=auto_migrate)
    if scheme == "memory":
        return MemoryStore()
    raise InvalidInput(
        f"unsupported database url {url.split('@')[-1]!r}: use postgresql://user@host/db, "
        "sqlite:///path/to/file.db or memory://"
    )
