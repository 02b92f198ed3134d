"""What flowlock does without a server for a transaction pooler: the statements' tables named
with the schema, and the `pooling=` choice checked before anything opens.

The real PgBouncer is in tests/integration/test_pgbouncer_pg.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

import flowlock
from flowlock.core.migrations import load
from flowlock.core.models import InstanceQuery
from flowlock.locks import MemoryLocks
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.stores.postgres import PostgresStore, outbox_sql, timer_sql
from flowlock.stores.postgres import sql as statements
from flowlock.stores.postgres.sql import qualified

PG = "postgresql://postgres@127.0.0.1:1/none"  # never connected to


def _tables() -> set[str]:
    """Every table the PostgreSQL migrations create."""
    found: set[str] = set()
    for migration in load("postgres"):
        found |= set(re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(flowlock_\w+)", migration.sql))
    return found


def test_every_table_of_every_statement_is_named_with_the_schema() -> None:
    """Each fixed statement of the store, qualified, names every table of flowlock's (as the
    migrations create them, so a new table is not forgotten) only as "s".table."""
    tables = _tables()
    assert {"flowlock_instances", "flowlock_history", "flowlock_timers"} <= tables
    assert "flowlock_outbox" in tables
    texts = [
        v
        for module in (statements, timer_sql, outbox_sql)
        for k, v in vars(module).items()
        if k.isupper() and isinstance(v, str)
    ]
    for text in texts:
        done = qualified(text, "s")
        for table in tables:
            # Left bare: a column's table (`flowlock_escalations.until`) only.
            bare = re.findall(rf'(?<![\w."]){table}\b(?!\.)', done)
            assert not bare, (table, done)


def test_the_outbox_wake_function_is_named_with_the_schema() -> None:
    """The function a retry, a drop or a release calls to wake the dispatchers is flowlock's
    too: named with the schema, since the connections have no search_path that finds it."""
    for text in (outbox_sql.RETRY_MESSAGE, outbox_sql.DROP_MESSAGE, outbox_sql.RELEASE_MESSAGE):
        done = qualified(text, "s")
        assert '"s".flowlock_outbox_wake()' in done
        assert not re.search(r'(?<![\w."])flowlock_outbox_wake\b', done)


def test_qualifying_leaves_other_names_alone() -> None:
    """A constraint, a savepoint, a name already qualified and a column's table stay as they are;
    the same text twice gives the same answer."""
    text = (
        "SAVEPOINT flowlock_cas; SELECT flowlock_escalations.until, x.flowlock_history "
        'FROM flowlock_escalations, "t".flowlock_instances -- flowlock_history_request_uniq'
    )
    done = qualified(text, "s")
    assert done == (
        "SAVEPOINT flowlock_cas; SELECT flowlock_escalations.until, x.flowlock_history "
        'FROM "s".flowlock_escalations, "t".flowlock_instances -- flowlock_history_request_uniq'
    )
    assert qualified(text, "s") is done


@pytest.mark.parametrize(
    "make",
    [
        lambda v: PostgresStore(PG, pooling=v),
        lambda v: AdvisoryLocks(PG, pooling=v),
        lambda v: flowlock.RunOnce(MemoryLocks(), PG, pooling=v),
        lambda v: flowlock.connect(PG, pooling=v),
    ],
    ids=["PostgresStore", "AdvisoryLocks", "RunOnce", "connect"],
)
@pytest.mark.parametrize("value", ["statement", "Transaction", "", 1, True])
def test_a_bad_pooling_choice_is_refused(make: Any, value: Any) -> None:
    """pooling= is "auto", "session" or "transaction"; anything else is InvalidInput naming
    the three, before any connection."""
    with pytest.raises(flowlock.InvalidInput) as refused:
        make(value)
    assert "pooling" in str(refused.value) and "'transaction'" in str(refused.value)


@pytest.mark.parametrize("url", ["sqlite:///x.db", "memory://"])
def test_pooling_means_nothing_without_postgresql(url: str) -> None:
    """connect(pooling=...) on SQLite or the memory store is refused, not ignored."""
    with pytest.raises(flowlock.InvalidInput, match="pooling"):
        flowlock.connect(url, pooling="session")


def test_a_name_in_a_literal_is_not_a_table() -> None:
    """A workflow or state named like a table, written into a filter as a literal, stays a
    literal: only the tables themselves are named with the schema."""
    sql, _ = statements.list_statement(
        InstanceQuery("flowlock_history", ("flowlock_instances",), None, None),
        after=None,
        limit=10,
    )
    out = qualified(sql, "s")
    assert "'flowlock_history'" in out and "'flowlock_instances'" in out
    assert 'FROM "s".flowlock_instances' in out
