"""Queries without a server: the page cursor, and the plans SQLite makes for the store's queries."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import flowlock
from flowlock.core.models import InstanceQuery
from flowlock.core.query import cursor_after, decode_cursor
from flowlock.stores import MemoryStore
from flowlock.stores.sqlite import SqliteStore, count_statement, list_statement

# The ids the engine accepts: 1 to 200 characters, none of them a control character.
IDS = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\x7f"),
    min_size=1,
    max_size=200,
)


@given(IDS)
def test_a_cursor_names_the_id_it_was_made_from(instance_id: str) -> None:
    """Every id the engine accepts makes a cursor of URL-safe characters that decodes to it."""
    cursor = cursor_after(instance_id)
    assert cursor.isascii() and all(c.isalnum() or c in "-_" for c in cursor)
    assert decode_cursor(cursor) == instance_id


def test_no_cursor_is_the_first_page() -> None:
    """after=None starts at the beginning."""
    assert decode_cursor(None) is None


@pytest.mark.parametrize(
    "bad",
    ["", "a", "=", "aTE6", "aTE6\x00", "QUJD", "aTE6cjI=", "aTE6cjI\n", cursor_after("x") + "A"],
)
def test_what_is_not_a_cursor_is_invalid_input(bad: str) -> None:
    """Strings that are not a cursor made by a page (empty, cut, padded, another encoding)
    raise InvalidInput telling the caller to pass next_cursor as given."""
    with pytest.raises(flowlock.InvalidInput, match="next_cursor"):
        decode_cursor(bad)


async def test_sqlite_pages_by_state_from_the_index(tmp_path: Path) -> None:
    """On SQLite a page of one workflow's state searches the (workflow, state, id) index of
    003_queries.sql and needs no sort (a count reads only that index); a page without filters
    walks the primary key."""
    path = tmp_path / "q.db"
    async with SqliteStore(path):
        pass  # migrated
    conn = sqlite3.connect(path)
    try:

        def plan(sql: str, args: list[object]) -> str:
            rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", args).fetchall()
            return " | ".join(str(r[-1]) for r in rows)

        pending = InstanceQuery(workflow="approval", states=("pending",))
        by_state = plan(*list_statement(pending, after="r-1", limit=101))
        assert "USING INDEX flowlock_instances_by_state" in by_state, by_state
        assert "TEMP B-TREE" not in by_state, by_state
        assert "COVERING INDEX flowlock_instances_by_state" in plan(*count_statement(pending))
        everything = plan(*list_statement(InstanceQuery(), after=None, limit=101))
        assert "TEMP B-TREE" not in everything, everything
        assert "USING INDEX sqlite_autoindex_flowlock_instances_1 (id>?)" in everything, everything
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("after", "limit"), [(-1, None), (True, None), ("3", None), (0, 0), (0, False), (0, 2.5)]
)
async def test_a_bad_history_page_is_invalid_input(after: object, limit: object) -> None:
    """A history page's bounds are checked before anything is read, naming the bad one."""
    engine = flowlock.Engine(MemoryStore())
    async with engine:
        with pytest.raises(flowlock.InvalidInput, match=r"after|limit"):
            await engine.history("i", after=after, limit=limit)  # type: ignore[arg-type]
