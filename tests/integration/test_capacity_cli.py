"""`flowlock capacity KIND KEY` and the constraint rules of `flowlock check`, on a database
filled through the engine, on PostgreSQL (a schema of its own) and on a SQLite file.

The command line registers no workflow: the rule, limit and window come from the stored
definitions. Skipped where the store does not keep constraints yet (no flowlock_capacity
table)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from test_inspect_cli import Db
from typer.testing import CliRunner, Result

import flowlock
import pg_budget
from flowlock.cli import EXIT_VERDICT_FAILED, app

CAP = "review.in_review"


def _reviewer(inst: flowlock.Instance) -> str:
    return str(inst.data["reviewer"])


def _review() -> flowlock.Workflow:
    """Two reviews per reviewer at a time; three starts a minute per reviewer."""
    in_review = flowlock.State("in_review", capacity=flowlock.Capacity(key=_reviewer, limit=2))
    per_minute = flowlock.Rate(key=_reviewer, per=timedelta(minutes=1), limit=3)
    return flowlock.Workflow(
        "review",
        states=["queued", in_review, "done"],
        initial="queued",
        transitions=[
            flowlock.Transition("start", source="queued", target="in_review", rate=per_minute),
            flowlock.Transition("finish", source="in_review", target="done"),
        ],
    )


async def _has_table(db: Db) -> bool:
    if db.kind == "sqlite":
        lite = sqlite3.connect(db.url.removeprefix("sqlite:///"))
        try:
            query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
            return lite.execute(query, ("flowlock_capacity",)).fetchone() is not None
        finally:
            lite.close()
    pg = await pg_budget.connect(db.url)
    try:
        found = await pg.fetchval(f"SELECT to_regclass('\"{db.schema}\".flowlock_capacity')")
        return found is not None
    finally:
        await pg.close()


async def _fill(db: Db) -> None:
    """a finished; b and c hold reviewer r's two slots; d waits in the queue."""
    async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
        if not await _has_table(db):
            pytest.skip(f"the {db.kind} store keeps no constraints yet (no flowlock_capacity)")
        await engine.register(_review())
        for name in "abcd":
            await engine.create("review", instance_id=name, data={"reviewer": "r"})
        for name, event in (("a", "start"), ("b", "start"), ("a", "finish"), ("c", "start")):
            await engine.fire(name, event)


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    found = Db.of(request, tmp_path)
    asyncio.run(_fill(found))
    return found


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return CliRunner()


def _run(cli: CliRunner, db: Db, *args: str, code: int = 0) -> Result:
    result = cli.invoke(app, [*args, *db.args])
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, result.output
    return result


def test_capacity_prints_the_holders_limit_used_and_free(cli: CliRunner, db: Db) -> None:
    """The text names the rule, limit, used, free and the holders oldest first; --json is the
    same as GET /capacity/{kind}/{key} answers."""
    text = _run(cli, db, "capacity", CAP, "r").stdout
    for line in ("rule     capacity", "limit    2", "used     2", "free     0", "holders  b, c"):
        assert line in text, text
    shown = json.loads(_run(cli, db, "capacity", CAP, "r", "--json").stdout)
    assert shown == {
        "kind": CAP, "key": "r", "limit": 2, "holders": ["b", "c"], "used": 2, "free": 0,
        "rule": "capacity", "window": None,
    }  # fmt: skip
    other = json.loads(_run(cli, db, "capacity", CAP, "nobody", "--json").stdout)
    assert (other["holders"], other["limit"], other["free"]) == ([], 2, 2)


def test_capacity_of_a_rate_shows_the_window(cli: CliRunner, db: Db) -> None:
    """A rate limit's holders are the instances of the applications in its window."""
    shown = json.loads(_run(cli, db, "capacity", "review.start.rate", "r", "--json").stdout)
    assert (shown["rule"], shown["limit"], shown["window"]) == ("rate", 3, 60.0)
    assert shown["holders"] == ["a", "b", "c"]


def test_capacity_of_an_unknown_kind_exits_1(cli: CliRunner, db: Db) -> None:
    """A kind no stored definition or row knows is an error naming the kinds known."""
    result = _run(cli, db, "capacity", "nope", "x", code=1)
    assert "review.in_review" in result.output and "review.start.rate" in result.output


def test_check_proves_the_constraints_and_finds_a_deleted_slot(cli: CliRunner, db: Db) -> None:
    """check counts the slot and rate events and is clean; a slot row deleted behind flowlock's
    back is a slot-counter violation (exit 3)."""
    clean = _run(cli, db, "check").stdout
    assert "4 slot event(s)" in clean and "3 rate event(s)" in clean, clean
    report = json.loads(_run(cli, db, "check", "--json").stdout)
    assert report["ok"] and (report["slot_events"], report["rate_events"]) == (4, 3)
    db.execute("DELETE FROM flowlock_slots WHERE instance_id = 'c'")
    broken = json.loads(_run(cli, db, "check", "--json", code=EXIT_VERDICT_FAILED).stdout)
    assert "slot-counter" in {v["kind"] for v in broken["violations"]}, broken
