"""Versioned SQL migrations shipped inside the package (`stores/sql/<dialect>/NNN_name.sql`).

The ones not yet recorded in `flowlock_schema_migrations` are applied in name order under a
cross-process lock: on PostgreSQL by `flowlock._pg.migrations` (an advisory lock; shared by
the store, the advisory locks and the run-once jobs), on SQLite by the store (`BEGIN
IMMEDIATE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

__all__ = ["Migration", "load"]


@dataclass(frozen=True, slots=True)
class Migration:
    name: str
    sql: str


def load(dialect: str) -> list[Migration]:
    """The migrations of `dialect` ("postgres" or "sqlite"), oldest first."""
    folder = resources.files("flowlock.stores").joinpath("sql", dialect)
    found = [
        Migration(entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
    ]
    return sorted(found, key=lambda m: m.name)
