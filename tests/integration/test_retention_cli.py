"""`flowlock admin purge|restore|hold|unhold|holds` through typer's runner, on a SQLite file and on
PostgreSQL (a schema of its own), on instances the test makes through the engine and then ages
past `--older-than 1s` by moving their `updated_at` an hour back (tests/age_kit.py; the command
still measures the age on the database's clock). After a restore, `flowlock check` passes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_inspect_cli import Db
from typer.testing import CliRunner, Result

import flowlock
from age_kit import backdate_pg, backdate_sqlite
from flowlock.cli import app
from flowlock.cli._age import parse_age

APP = "flowlock.examples:approval"
FINAL = ["a-1", "a-2", "a-3", "r-1"]  # approved or rejected
OPEN = ["p-1", "p-2"]  # pending


async def _fill(db: Db) -> None:
    async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
        await engine.register(flowlock.examples.approval())
        for iid in [*FINAL, *OPEN]:
            await engine.create("approval", instance_id=iid, data={"id": iid})
        for iid in FINAL:
            await engine.fire(iid, "reject" if iid.startswith("r") else "approve", actor="ann")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    found = Db.of(request, tmp_path)
    asyncio.run(_fill(found))
    _age(found, [*FINAL, *OPEN])  # older than --older-than 1s
    return found


def _age(db: Db, ids: list[str]) -> None:
    if db.kind == "sqlite":
        backdate_sqlite(db.url.removeprefix("sqlite:///"), ids)
    else:
        asyncio.run(backdate_pg(db.url, db.schema, ids))


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    monkeypatch.delenv("FLOWLOCK_APP", raising=False)
    return CliRunner()


def _run(cli: CliRunner, db: Db, *args: str, answer: str | None = None) -> Result:
    result = cli.invoke(app, ["admin", *args, *db.args], input=answer)
    assert "Traceback" not in result.output, result.output
    return result


def _text(result: Result) -> str:
    return " ".join(result.output.split())


def _ids(cli: CliRunner, db: Db) -> list[str]:
    result = cli.invoke(app, ["list", "--json", "--limit", "100", *db.args])
    assert result.exit_code == 0, result.output
    return sorted(i["id"] for i in json.loads(result.stdout))


def test_ages_parse_in_weeks_days_hours_minutes_and_seconds() -> None:
    assert [parse_age(a).total_seconds() for a in ("2w", "90d", "12h", "30m", "45s")] == [
        14 * 86400, 90 * 86400, 12 * 3600, 1800, 45,
    ]  # fmt: skip


def test_purge_counts_first_asks_and_holds_exempt(cli: CliRunner, db: Db) -> None:
    purge = ("purge", "--workflow", "approval", "--final", "--older-than", "1s", "--app", APP)
    held = _run(cli, db, "hold", "a-2", "--reason", "case 7", "--actor", "legal")
    assert held.exit_code == 0 and "case 7" in held.output
    # The command as written: no --app, so the example approval's final states.
    dry = _run(cli, db, *purge[:-2], "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    counted = json.loads(dry.stdout)
    assert (counted["dry_run"], counted["matched"], counted["held"]) == (True, 3, 1)
    assert _ids(cli, db) == sorted([*FINAL, *OPEN])

    declined = _run(cli, db, *purge, answer="n\n")
    assert declined.exit_code == 1
    assert "3 instance(s) of 'approval' older than 1s would be purged (1 more held)" in _text(
        declined
    )
    assert _ids(cli, db) == sorted([*FINAL, *OPEN])

    done = _run(cli, db, *purge, answer="y\n")
    assert done.exit_code == 0, done.output
    assert "purged 3 instance(s) of 'approval'" in _text(done)
    assert _ids(cli, db) == sorted(["a-2", *OPEN])

    listed = _run(cli, db, "holds", "--json")
    assert [h["instance_id"] for h in json.loads(listed.stdout)] == ["a-2"]
    assert _run(cli, db, "unhold", "a-2").exit_code == 0
    assert _run(cli, db, "unhold", "a-2").exit_code == 1
    assert _run(cli, db, *purge, "--yes").exit_code == 0
    assert _ids(cli, db) == OPEN
    # Too late: the instance is gone. The hold stands for the id, and the command says so.
    late = _run(cli, db, "hold", "a-2", "--reason", "case 8", "--json")
    assert late.exit_code == 0, late.output
    assert json.loads(late.stdout)["instance_found"] is False
    assert "no instance has the id a-2" in " ".join(late.stderr.split())


def test_archive_restore_and_check(cli: CliRunner, db: Db, tmp_path: Path) -> None:
    archive = tmp_path / "approval.jsonl.gz"
    args = ("--workflow", "approval", "--state", "approved", "--state", "rejected")
    done = _run(cli, db, "purge", *args, "--older-than", "1s", "--archive", str(archive), "--yes")
    assert done.exit_code == 0, done.output
    assert _ids(cli, db) == OPEN
    again = _run(cli, db, "purge", *args, "--older-than", "1s", "--archive", str(archive), "-y")
    assert again.exit_code == 1 and "never overwritten" in _text(again)

    restored = _run(cli, db, "restore", str(archive), "--json")
    assert restored.exit_code == 0, restored.output
    report = json.loads(restored.stdout)
    assert (report["lines"], report["restored"], report["skipped"]) == (4, 4, [])
    assert _ids(cli, db) == sorted([*FINAL, *OPEN])
    checked = cli.invoke(app, ["check", *db.args])
    assert checked.exit_code == 0, checked.output
    assert "clean, exactly-once" in checked.output

    skipped = _run(cli, db, "restore", str(archive))
    assert skipped.exit_code == 0 and "4 skipped" in _text(skipped)
    archive.write_bytes(archive.read_bytes()[:-3] + b"xyz")
    damaged = _run(cli, db, "restore", str(archive))
    assert damaged.exit_code == 1
    assert "approval.jsonl.gz" in _text(damaged) and "sha256" in _text(damaged)


def test_bad_arguments_are_usage_errors(cli: CliRunner, db: Db) -> None:
    base = ("purge", "--workflow", "approval")
    for bad in ("90", "0d", "1y", "d", "99999999999d", "5300w", "9" * 5000 + "s"):
        result = _run(cli, db, *base, "--final", "--app", APP, "--older-than", bad)
        assert result.exit_code == 2, (bad, result.output)
    assert _run(cli, db, *base, "--older-than", "1s").exit_code == 2  # neither --final nor --state
    # Without --app, --final reads flowlock's examples (as serve does); another name is refused.
    unknown = _run(cli, db, "purge", "--workflow", "nosuch", "--final", "--older-than", "1s")
    assert unknown.exit_code == 2 and "--app" in _text(unknown)
    assert _ids(cli, db) == sorted([*FINAL, *OPEN])


def test_without_app_a_workflow_unlike_the_example_is_refused(cli: CliRunner, db: Db) -> None:
    # A workflow of the user's own also named "approval", with a state the example lacks: the
    # example's final states are not its final states, so nothing is purged without --app.
    own = flowlock.Workflow(
        "approval",
        states=["pending", "approved", "archived"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition("archive", source="approved", target="archived"),
        ],
    )

    async def fill() -> None:
        async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
            await engine.register(own)
            await engine.create("approval", instance_id="own-1", data={})
            await engine.fire("own-1", "approve")
            await engine.fire("own-1", "archive")

    asyncio.run(fill())
    _age(db, ["own-1"])
    refused = _run(cli, db, "purge", "--workflow", "approval", "--final", "--older-than", "1s",
                   "--yes")  # fmt: skip
    assert refused.exit_code == 1
    assert "your own workflow" in _text(refused) and "--app" in _text(refused)
    assert "own-1" in _ids(cli, db) and _ids(cli, db) == sorted(["own-1", *FINAL, *OPEN])
