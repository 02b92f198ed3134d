"""`flowlock definitions` and `flowlock show`'s definition line, on a database filled with two
versions of a workflow, on PostgreSQL (a schema of its own) and on a SQLite file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_inspect_cli import Db
from typer.testing import CliRunner, Result

import flowlock
from flowlock.cli import app
from flowlock.core.versions import content_hash


def _doc(*, drop_review: bool = False) -> flowlock.Workflow:
    """Version 1 has a review state; version 2 drops it."""
    states = ["draft", "done"] if drop_review else ["draft", "review", "done"]
    transitions = (
        [flowlock.Transition("finish", source="draft", target="done")]
        if drop_review
        else [
            flowlock.Transition("submit", source="draft", target="review"),
            flowlock.Transition("approve", source="review", target="done"),
        ]
    )
    return flowlock.Workflow("doc", states=states, initial="draft", transitions=transitions)


async def _fill(db: Db) -> None:
    """ "old" runs version 1 and sits in review; "new" runs version 2."""
    async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
        await engine.register(_doc())
        await engine.create("doc", instance_id="old")
        await engine.fire("old", "submit")
        await engine.register(_doc(drop_review=True))
        await engine.create("doc", instance_id="new")


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


def _run(cli: CliRunner, db: Db, *args: str) -> Result:
    result = cli.invoke(app, [*args, *db.args])
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 0, result.output
    return result


def test_definitions_lists_each_version_with_its_instances(cli: CliRunner, db: Db) -> None:
    """The table shows workflow, version, the hash's start, created and the instance count;
    --json gives the whole hash and the canonical definition; WORKFLOW filters."""
    shown = _run(cli, db, "definitions").stdout
    first, second = content_hash(_doc()), content_hash(_doc(drop_review=True))
    assert "2 version(s)" in shown
    assert first[:12] in shown and second[:12] in shown and first not in shown
    listed = json.loads(_run(cli, db, "definitions", "doc", "--json").stdout)
    assert [(v["version"], v["hash"], v["instances"]) for v in listed] == [
        (1, first, 1),
        (2, second, 1),
    ]
    assert listed[0]["definition"]["states"] == ["draft", "review", "done"]
    assert json.loads(_run(cli, db, "definitions", "other", "--json").stdout) == []


def test_show_says_a_state_the_newest_definition_lacks_is_not_final(cli: CliRunner, db: Db) -> None:
    """An instance in a state version 2 dropped is shown running version 1, with the state
    named as missing from the newest definition, never as a final state."""
    shown = _run(cli, db, "show", "old").stdout
    assert "version 1" in shown
    assert "'review' is not in the newest definition, version 2" in shown
    assert "final" not in shown
    body = json.loads(_run(cli, db, "show", "old", "--json").stdout)
    assert body["definition_version"] == 1
    assert (body["newest_definition_version"], body["state_in_newest_definition"]) == (2, False)
    fresh = json.loads(_run(cli, db, "show", "new", "--json").stdout)
    assert (fresh["definition_version"], fresh["state_in_newest_definition"]) == (2, True)
