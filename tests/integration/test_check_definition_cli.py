"""`flowlock check-definition MODULE:ATTR`, run as a user runs it (a subprocess, the definitions
in a module file of the current directory): exit 0 when the histories replay clean, 1 on any
divergence, 2 on bad usage; --json for scripts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flowlock

FLOWS = """
import flowlock
from flowlock import Transition, Workflow


def _bump(inst, payload, actor):
    return {**inst.data, "n": inst.data.get("n", 0) + 1}


def _bump_twice(inst, payload, actor):
    return {**inst.data, "n": inst.data.get("n", 0) + 2}


def _doc(review="review", effect=_bump, extra=()):
    return Workflow(
        "doc",
        states=["draft", review, "done", *extra],
        initial="draft",
        transitions=[
            Transition("submit", source="draft", target=review, effect=effect),
            Transition("finish", source=review, target="done"),
            *(Transition(f"to_{s}", source="done", target=s) for s in extra),
        ],
    )


current = _doc()
compatible = _doc(extra=["archived"])
renamed = _doc(review="checking")
recount = _doc(effect=_bump_twice)
"""


def _cli(cwd: Path, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWLOCK_")}
    env["COLUMNS"] = "200"
    if url is not None:
        env["FLOWLOCK_DATABASE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "flowlock", "check-definition", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _record(url: str, cwd: Path, schema: str | None = None) -> None:
    """Three instances under the current definition, written through the sync engine."""
    spec = importlib.util.spec_from_file_location("flows_under_test", cwd / "flows_under_test.py")
    assert spec is not None and spec.loader is not None
    flows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flows)
    with flowlock.sync.Engine.connect(url, schema=schema) as engine:
        engine.register(flows.current)
        for n in range(3):
            engine.create("doc", instance_id=f"d{n}", data={"n": 0})
            engine.fire(f"d{n}", "submit")
        engine.fire("d0", "finish")


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, str]:
    """A module of definitions in tmp_path and an SQLite database holding histories of one."""
    (tmp_path / "flows_under_test.py").write_text(FLOWS, encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'app.db'}"
    _record(url, tmp_path)
    return tmp_path, url


def test_clean_and_compatible_definitions_exit_0(recorded: tuple[Path, str]) -> None:
    """The recorded definition and a compatible change (a new state and transition) exit 0."""
    cwd, url = recorded
    for attr in ("current", "compatible"):
        done = _cli(cwd, f"flows_under_test:{attr}", "--database-url", url)
        assert done.returncode == 0, done.stderr + done.stdout
        assert "replayed 4 transition(s) of 3 instance(s)" in done.stdout
        assert "no divergence" in done.stdout


def test_a_divergence_exits_1_with_a_table(recorded: tuple[Path, str]) -> None:
    """A renamed state exits 1, printing each divergence and a summary by kind (the URL read from
    FLOWLOCK_DATABASE_URL)."""
    cwd, url = recorded
    done = _cli(cwd, "flows_under_test:renamed", url=url)
    assert done.returncode == 1, done.stderr + done.stdout
    out = done.stdout
    assert "divergences of workflow 'doc'" in out
    assert "checking" in out and "target" in out
    assert "divergence(s) (" in out and "state" in out


def test_json_lists_every_divergence(recorded: tuple[Path, str]) -> None:
    """--json prints the reports, each divergence with its recorded and new values; a sample is
    honoured."""
    cwd, url = recorded
    done = _cli(cwd, "flows_under_test:recount", "--database-url", url, "--json")
    assert done.returncode == 1, done.stderr
    body = json.loads(done.stdout)
    assert body["ok"] is False
    [report] = body["reports"]
    assert report["counts"]["data"] == 3
    assert {d["instance_id"] for d in report["divergences"]} == {"d0", "d1", "d2"}
    assert report["divergences"][0]["expected"] == {"n": 1}
    assert report["divergences"][0]["found"] == {"n": 2}
    sampled = _cli(
        cwd, "flows_under_test:current", "--database-url", url, "--json", "--sample", "2"
    )
    assert sampled.returncode == 0, sampled.stderr
    assert json.loads(sampled.stdout)["reports"][0]["checked_instances"] == 2


def test_bad_usage_exits_2(recorded: tuple[Path, str]) -> None:
    """No database, a reference that names nothing, or a bad --sample: exit 2, nothing read."""
    cwd, url = recorded
    assert _cli(cwd, "flows_under_test:current").returncode == 2
    missing = _cli(cwd, "flows_under_test:nothing", "--database-url", url)
    assert missing.returncode == 2 and "nothing" in missing.stderr
    assert (
        _cli(cwd, "flows_under_test:current", "--sample", "0", "--database-url", url).returncode
        == 2
    )


@pytest.mark.postgres
def test_on_postgresql(tmp_path: Path, pg_url: str, pg_schema: str) -> None:
    """The same on PostgreSQL, in the schema given with --schema."""
    (tmp_path / "flows_under_test.py").write_text(FLOWS, encoding="utf-8")
    _record(pg_url, tmp_path, pg_schema)
    ok = _cli(tmp_path, "flows_under_test:current", "--database-url", pg_url, "--schema", pg_schema)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    bad = _cli(
        tmp_path, "flows_under_test:recount", "--database-url", pg_url, "--schema", pg_schema
    )
    assert bad.returncode == 1, bad.stderr + bad.stdout
