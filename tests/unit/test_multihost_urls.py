"""libpq multi-host URLs (``postgresql://h1:5432,h2:5433/db?target_session_attrs=read-write``)
are accepted wherever a PostgreSQL URL is, and every place that shows a URL shows all of its
hosts and none of its password. No server needed: nothing here opens a connection (the
same URLs on a real server: tests/integration/test_multihost_pg.py, tests/ha/)."""

from __future__ import annotations

import pytest

import flowlock
from flowlock._pg.errors import cannot_connect
from flowlock.backends import build_store
from flowlock.bench.config import BenchConfig, redact
from flowlock.bench.servers import store_error
from flowlock.cli._common import redact as _redact
from flowlock.jobs import RunOnce
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.stores.postgres import PostgresStore

URL = "postgresql://me:secret@db1:5432,db2:5433/app?target_session_attrs=read-write"
HOSTS = "db1:5432,db2:5433/app?target_session_attrs=read-write"
SHOWN = "postgresql://me:***@db1:5432,db2:5433/app?target_session_attrs=read-write"


@pytest.mark.parametrize(
    "url",
    [
        URL,
        "postgres://db1,db2/app",  # the default port for each
        "postgresql://[::1]:5432,db2/app?target_session_attrs=primary",
        "postgresql:///app?host=db1,db2&port=5432,5433&target_session_attrs=read-write",
    ],
)
def test_connect_accepts_a_multi_host_url_and_opens_nothing(url: str) -> None:
    """Engine.connect and build_store take the URL as it is (asyncpg parses the hosts when the
    pool opens); nothing is opened yet."""
    store = build_store(url)
    assert isinstance(store, PostgresStore) and store.dsn == url
    engine = flowlock.Engine.connect(url, application_name="app-1")
    assert isinstance(engine.store, PostgresStore) and engine.store.dsn == url
    locks = AdvisoryLocks(url)
    assert locks.dsn == url
    RunOnce(locks, url)


def test_redaction_keeps_every_host_and_hides_the_password() -> None:
    """The benchmark's report and the CLI show the URL with every host, its password ***."""
    assert redact(URL) == SHOWN
    assert _redact(URL) == SHOWN
    assert redact(URL.replace("me:secret@", "")) == URL.replace("me:secret@", "")


def test_messages_name_every_host_and_no_password() -> None:
    """A failure to connect, the advisory backend's repr and the benchmark's own errors name
    the hosts (all of them) and never the password."""
    shown = [
        str(cannot_connect(OSError("refused"), URL)),
        repr(AdvisoryLocks(URL)),
        str(store_error(OSError("refused"), URL, "reading")),
    ]
    for text in shown:
        assert HOSTS in text, text
        assert "secret" not in text, text


def test_the_benchmark_takes_a_multi_host_url() -> None:
    assert BenchConfig(database_url=URL).database_url == URL
