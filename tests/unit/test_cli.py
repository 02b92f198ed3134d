"""The `flowlock` command line: version, help, argument errors, error lines and exit codes.

No database is needed: every case here fails (or is answered) before any connection is made, or
runs the bench with the runner replaced by a canned report.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flowlock
from flowlock.bench import BenchConfig, BenchReport, Progress, ScenarioResult
from flowlock.bench import runner as bench_runner
from flowlock.bench.extend import LAB_MISSING, Lab
from flowlock.checker import Verdict, Violation
from flowlock.cli import EXIT_VERDICT_FAILED, app
from flowlock.core.errors import InvalidInput, StoreError
from flowlock.core.install import lab_install


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner with FLOWLOCK_DATABASE_URL unset, so the environment cannot steer a test."""
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    return CliRunner()


def _result(verdict: Verdict) -> ScenarioResult:
    return ScenarioResult(
        scenario="storm",
        strategy="optimistic",
        workers=3,
        rounds=1,
        calls=3,
        avg_ms=1.0,
        p50_ms=1.0,
        p99_ms=2.0,
        max_ms=2.0,
        success_pct=100.0,
        attempts_per_call=1.0,
        calls_per_s=100.0,
        applied_per_s=33.3,
        peak_connections=3,
        peak_active_connections=1,
        double_advanced_rounds=0 if verdict.ok else 1,
        applied=1 if verdict.ok else 2,
        idempotent=2 if verdict.ok else 1,
        refused=0,
        failed=0,
        applied_per_round=(1,) if verdict.ok else (2,),
        errors={},
        wall_s=0.03,
        loop="asyncio",
        verdict=verdict,
    )


def _report(verdict: Verdict) -> BenchReport:
    return BenchReport(
        flowlock_version=flowlock.__version__,
        postgres_version="18.0",
        redis_version=None,
        cores=2,
        args={"workers": 3},
        results=(_result(verdict),),
        loop="asyncio",
        database="embedded",
        pool_size=3,
        duration_s=0.1,
    )


def test_version(cli: CliRunner) -> None:
    """--version prints the package version and exits 0."""
    result = cli.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"flowlock {flowlock.__version__}"


def test_help_names_the_environment_variables(cli: CliRunner) -> None:
    """Top-level help names every environment variable the CLI reads."""
    result = cli.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "FLOWLOCK_DATABASE_URL" in result.stdout
    for command in ("bench", "db", "show", "history", "list", "check", "timers", "outbox"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "--help"],
        ["db", "migrate", "--help"],
        *([name, "--help"] for name in ("show", "history", "list", "check", "timers")),
        *(["outbox", name, "--help"] for name in ("list", "retry", "drop")),
    ],
)
def test_subcommand_help_shows_the_env_var(cli: CliRunner, command: list[str]) -> None:
    """Each option read from the environment says so in its help."""
    result = cli.invoke(app, command)
    assert result.exit_code == 0
    assert "FLOWLOCK_DATABASE_URL" in result.stdout


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["bench", "--workers", "0"], "--workers"),
        (["bench", "--rounds", "-1"], "--rounds"),
        (["bench", "--scenario", "nope"], "unknown scenario 'nope'"),
        (["bench", "--strategy", "magic"], "unknown strategy 'magic'"),
        (["bench", "--no-such-option"], "No such option"),
        (["bench", "--json", "/no/such/dir/out.json"], "does not exist"),
        (["db", "migrate"], "FLOWLOCK_DATABASE_URL"),
        (["timers"], "FLOWLOCK_DATABASE_URL"),
        (["timers", "--within", "-1", "--database-url", "sqlite:///x.db"], "--within"),
        (["timers", "--limit", "0", "--database-url", "sqlite:///x.db"], "--limit"),
        (["outbox", "list"], "FLOWLOCK_DATABASE_URL"),
        (["outbox", "retry", "o-1:2:0"], "FLOWLOCK_DATABASE_URL"),
        (["outbox", "drop", "o-1:2:0", "--yes"], "FLOWLOCK_DATABASE_URL"),
        (["outbox", "list", "--status", "lost", "--database-url", "sqlite:///x.db"], "--status"),
        (["outbox", "list", "--limit", "0", "--database-url", "sqlite:///x.db"], "--limit"),
        (["outbox", "list", "--limit", "10001", "--database-url", "sqlite:///x.db"], "--limit"),
        (["outbox", "retry", "o-1", "--database-url", "sqlite:///x.db"], "KEY"),
        (["outbox", "drop", "o-1:two:0", "--database-url", "sqlite:///x.db"], "KEY"),
        (["outbox", "drop"], "Missing argument 'KEY'"),
        (["outbox", "purge"], "No such command"),
        (["nonsense"], "No such command"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    cli: CliRunner, args: list[str], mentions: str
) -> None:
    """Bad arguments are refused with exit code 2 and a message naming the problem."""
    result = cli.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert mentions in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["bench", "--database-url", "sqlite:///tmp/x.db"], "needs PostgreSQL"),
        (["bench", "--database-url", "mysql://u:secret@h/db"], "unsupported database url"),
        (["db", "migrate", "--database-url", "mysql://u@h/db"], "unsupported database url"),
    ],
)
def test_flowlock_error_is_one_red_line_and_exit_1(
    cli: CliRunner, args: list[str], mentions: str
) -> None:
    """A FlowlockError becomes one `error: ...` line on stderr, exit 1, no traceback."""
    result = cli.invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert mentions in lines[0]
    assert "Traceback" not in result.output
    assert "secret" not in result.output  # passwords never reach the terminal


def test_env_var_is_used_when_no_option_is_given(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FLOWLOCK_DATABASE_URL stands in for --database-url."""
    monkeypatch.setenv("FLOWLOCK_DATABASE_URL", "sqlite:///tmp/x.db")
    result = cli.invoke(app, ["bench"])
    assert result.exit_code == 1
    assert "needs PostgreSQL" in result.stderr


def test_error_during_the_run_keeps_details_below_the_red_line(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-line error (e.g. a server log tail) prints its first line as the error line."""

    def broken(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        raise StoreError("embedded PostgreSQL did not start\nLOG: could not bind\nFATAL: no")

    monkeypatch.setattr(bench_runner, "run", broken)
    result = cli.invoke(app, ["bench", "--quick"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "error: embedded PostgreSQL did not start"
    assert "FATAL: no" in result.stderr
    assert "Traceback" not in result.output


def test_bench_prints_table_and_writes_json(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A passing run prints the results and the seed comparison, writes JSON and exits 0."""
    seen: list[BenchConfig] = []

    def fake(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        seen.append(config)
        return _report(Verdict.of([]))

    monkeypatch.setattr(bench_runner, "run", fake)
    out = tmp_path / "out.json"
    result = cli.invoke(
        app,
        ["bench", "--quick", "-s", "storm", "-t", "optimistic", "--seed", "7", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert seen == [
        BenchConfig(
            scenarios=("storm",), strategies=("optimistic",), quick=True, seed=7, workers=100
        )
    ]
    assert "storm" in result.stdout
    assert "seed" in result.stdout
    data = json.loads(out.read_text())
    assert data["results"][0]["verdict"] == {"ok": True, "violations": []}
    assert data["redis_version"] is None


def test_failed_verdict_exits_non_zero_with_the_violations(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose checker verdict fails says so clearly and exits 3."""
    bad = Verdict.of([Violation("double-apply", "instance 'x': 2 transitions, 1 applied")])
    monkeypatch.setattr(bench_runner, "run", lambda config, progress=None, lab=None: _report(bad))
    result = cli.invoke(app, ["bench", "--quick"])
    assert result.exit_code == EXIT_VERDICT_FAILED
    assert "verdict FAILED" in result.stderr
    assert "2 transitions, 1 applied" in result.stderr


@pytest.mark.parametrize(
    "args", [["--hosts", "2"], ["--http", "--quick"], ["--soak", "5"], ["--soak", "5", "--faults"]]
)
def test_lab_modes_without_the_lab_say_how_to_install_it(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """Without flowlock_lab, --hosts, --http and --soak exit 1 with one line naming the local
    install of the lab, before anything starts."""
    started: list[BenchConfig] = []

    def run(
        config: BenchConfig, progress: Progress | None = None, lab: Lab | None = None
    ) -> BenchReport:
        started.append(config)
        return _report(Verdict.of([]))

    monkeypatch.setattr(bench_runner, "run", run)
    # None in sys.modules: every import of the lab fails as if it were not installed.
    monkeypatch.setitem(sys.modules, "flowlock_lab", None)
    monkeypatch.setitem(sys.modules, "flowlock_lab.cli", None)
    result = cli.invoke(app, ["bench", *args])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: {LAB_MISSING}"]
    assert LAB_MISSING.endswith(lab_install())
    assert started == []


async def test_a_lab_run_without_the_lab_is_refused_before_anything_starts() -> None:
    """The runner itself refuses --hosts and --http without the lab's parts: one InvalidInput."""
    for config in (BenchConfig(hosts=2), BenchConfig(http=True, quick=True)):
        with pytest.raises(InvalidInput, match=re.escape(LAB_MISSING)):
            await bench_runner.run_bench(config)
