"""The versioned SQL migrations shipped in the package (`stores/sql/<dialect>/NNN_name.sql`).

Here, not in `stores`, so the PostgreSQL plumbing in `_pg` reads them without importing a store.
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
    # Anchored at the top package: naming flowlock.stores would import it, and the memory store.
    folder = resources.files("flowlock").joinpath("stores", "sql", dialect)
    found = [
        Migration(entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
    ]
    return sorted(found, key=lambda m: m.name)
