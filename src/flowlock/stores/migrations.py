"""Versioned SQL migrations shipped inside the package (``stores/sql/<dialect>/NNN_name.sql``).

Each store applies the ones not yet recorded in ``flowlock_schema_migrations``, in name order,
under its own cross-process lock (an advisory lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite).
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
    """The migrations of ``dialect`` ("postgres" or "sqlite"), oldest first."""
    folder = resources.files("flowlock.stores").joinpath("sql", dialect)
    found = [
        Migration(entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
    ]
    return sorted(found, key=lambda m: m.name)
