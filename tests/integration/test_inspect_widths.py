"""The inspection commands read at 80 columns and at 200, and in scripts.

On a real PostgreSQL schema filled through the engine with 60-character ids, request ids and
actors, timers and outbox messages (one dead with a long error), each command (`show`,
`history`, `list`, `check`, `timers`, `outbox list`) is run as a user runs it: with `COLUMNS`
at 80 and at 200. No id, key or timestamp may be split across lines, no line may be wider than
COLUMNS (none of these tokens is longer than a line), and at 200 the wide commands are tables.
Each `--json` parses and holds the tokens whole. `FLOWLOCK_SCHEMA` stands for `--schema`
in each command, and `--schema` wins over it. One real process shows the width when piped
without COLUMNS: 80.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import flowlock
from flowlock.cli import app
from flowlock.stores.base import OutboxStore

WIDTHS = [80, 200]
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d:\d\d")
YEAR = re.compile(r"(?<![0-9a-f])\d{4}-")
BORDERS = "│┃║━─┏┓┗┛┡┩└┘┌┐╇╈┼┬┴├┤╍ "


def _token(prefix: str) -> str:
    """60 characters, unique in their first and last 12 (no digit run that reads as a year)."""
    body = (uuid.uuid4().hex + uuid.uuid4().hex).translate(
        str.maketrans("0123456789", "ghijklmnop")
    )
    return (prefix + body)[:60]


def _notify(inst: flowlock.Instance, payload: Any, actor: str | None) -> list[flowlock.Emit]:
    return [flowlock.Emit("notify-the-accounting-department", {"by": actor})]


WF = flowlock.Workflow(
    "purchase-approval",
    states=["pending", "approved", "rejected"],
    initial="pending",
    transitions=[
        flowlock.Transition("approve", source="pending", target="approved", emit=_notify),
        flowlock.Transition(
            "expire", source="pending", target="rejected", after=timedelta(hours=1)
        ),
    ],
)
ERROR = (
    "HTTP 503 from the accounting service at https://acct.example/notify: upstream timed out "
    "after 30 s while it was asked about a purchase approval; given up, will not retry"
)


class Filled:
    """What the fill made: the schema, and the tokens the output must hold whole."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.ids = [_token("po-") for _ in range(3)]
        self.request_id = _token("rq-")
        self.actor = _token("ac-")
        self.keys: list[str] = []

    @property
    def tokens(self) -> list[str]:
        return [*self.ids, self.request_id, self.actor]

    async def fill(self) -> None:
        """Three pending instances (each with an expire timer an hour out); the first approved
        by the long actor under the long request id, its message failed dead."""
        async with flowlock.Engine.connect(self.url, schema=self.schema, timers=False) as engine:
            await engine.register(WF)
            for iid in self.ids:
                await engine.create(WF.name, instance_id=iid, data={"note": "x " * 60})
            await engine.fire(self.ids[0], "approve", actor=self.actor, request_id=self.request_id)
            store = engine.store
            assert isinstance(store, OutboxStore)
            [message] = await store.claim_messages(
                {"notify-the-accounting-department": 1}, lease=30.0, owner="test"
            )
            assert await store.fail_message(message, "test", ERROR, None)
            self.keys = [message.key]


@pytest.fixture
def filled(pg_url: str, pg_schema: str) -> Filled:
    made = Filled(pg_url, pg_schema)
    asyncio.run(made.fill())
    return made


def _run(filled: Filled, args: list[str], **env: str) -> Result:
    """The command with the URL and the schema from the environment, as an operator sets them."""
    environment = {"FLOWLOCK_DATABASE_URL": filled.url, "FLOWLOCK_SCHEMA": filled.schema, **env}
    result = CliRunner().invoke(app, args, env=environment)
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 0, result.output
    return result


def _commands(filled: Filled) -> dict[str, list[str]]:
    first = filled.ids[0]
    return {
        "show": ["show", first],
        "history": ["history", first],
        "list": ["list"],
        "check": ["check"],
        "timers": ["timers", "--within", "7200"],
        "outbox": ["outbox", "list"],
    }


def _assert_whole(output: str, filled: Filled, width: int) -> None:
    """No token split: a line holding the start or the end of a token holds all of it (a
    message key, which starts with its instance's id, by its end); every timestamp begun on a
    line ends on it; no line wider than `width`."""
    lines = output.splitlines()
    tokens = [*filled.tokens, *filled.keys]
    for line in lines:
        assert len(line) <= width, (width, line)
        for token in filled.tokens:
            if token[:12] in line or token[-12:] in line:
                assert token in line, (token, line, output)
        for key in filled.keys:
            if key[-12:] in line:
                assert key in line, (key, line, output)
        # Each year begun on a line is a whole timestamp there.
        assert len(YEAR.findall(line)) == len(TIMESTAMP.findall(line)), (line, output)
        # A table's cell that is only the start of a token: the rest went to the next line.
        cells = {cell.strip(BORDERS) for cell in re.split("[│┃║]", line)} - {""} - set(tokens)
        for cell in cells:
            broken = [t for t in tokens if len(cell) >= 3 and t.startswith(cell)]
            assert not broken, (broken, line, output)


@pytest.mark.parametrize("width", WIDTHS)
def test_every_command_keeps_tokens_whole(filled: Filled, width: int) -> None:
    """Each command at COLUMNS=width: tokens and timestamps whole, lines within the width;
    what each must show is there."""
    expected = {
        "show": [filled.ids[0]],
        "history": [filled.ids[0], filled.request_id, filled.actor],
        "list": filled.ids,
        "check": [],
        "timers": filled.ids[1:],
        "outbox": filled.keys,
    }
    for name, args in _commands(filled).items():
        output = _run(filled, args, COLUMNS=str(width)).stdout
        _assert_whole(output, filled, width)
        lines = output.splitlines()
        for token in expected[name]:
            assert any(token in line for line in lines), (name, token, output)
        assert TIMESTAMP.search(output) or name == "check", (name, output)
        if width == 200 and name in ("list", "timers", "outbox"):
            # A table: it fits. (history's row, with a 60-character actor and request id, is
            # over 200 wide: blocks.)
            assert "│" in output, (name, output)


def test_the_long_error_wraps_at_spaces(filled: Filled) -> None:
    """At 80 columns the outbox's error is free text: wrapped at spaces, every word whole."""
    output = _run(filled, ["outbox", "list"], COLUMNS="80").stdout
    words = set(output.split())
    assert set(ERROR.split()) <= words, output


@pytest.mark.parametrize("width", WIDTHS)
def test_every_command_prints_json_that_parses(filled: Filled, width: int) -> None:
    """--json on each command, at either width: JSON, with the long tokens whole."""
    for name, args in _commands(filled).items():
        output = _run(filled, [*args, "--json"], COLUMNS=str(width)).stdout
        value = json.loads(output)
        text = json.dumps(value)
        for token in {"show": filled.ids[:1], "list": filled.ids, "outbox": filled.keys}.get(
            name, []
        ):
            assert token in text, (name, token)
        if name == "history":
            [entry] = value
            assert (entry["request_id"], entry["actor"]) == (filled.request_id, filled.actor)
        if name == "check":
            assert value["ok"] is True and value["instances"] == 3, value


def test_the_schema_comes_from_the_environment(filled: Filled, pg_url: str) -> None:
    """FLOWLOCK_SCHEMA is read by show, list, history, check (and timers, outbox list): the
    instances of that schema are found with no --schema; --schema wins over it."""
    first = filled.ids[0]
    shown = json.loads(_run(filled, ["show", first, "--json"]).stdout)
    assert shown["id"] == first and shown["state"] == "approved"
    listed = json.loads(_run(filled, ["list", "--json"]).stdout)
    assert sorted(i["id"] for i in listed) == sorted(filled.ids)
    [entry] = json.loads(_run(filled, ["history", first, "--json"]).stdout)
    assert entry["event"] == "approve"
    assert json.loads(_run(filled, ["check", "--json"]).stdout)["instances"] == 3
    assert (
        len(json.loads(_run(filled, ["timers", "--within", "7200", "--json"]).stdout)["timers"])
        == 2
    )
    assert len(json.loads(_run(filled, ["outbox", "list", "--json"]).stdout)["messages"]) == 1
    # --schema over the variable: the variable names a schema with nothing in it.
    env = {"FLOWLOCK_DATABASE_URL": pg_url, "FLOWLOCK_SCHEMA": "no_such_schema_here"}
    runner = CliRunner()
    refused = runner.invoke(app, ["show", first, "--json"], env=env)
    assert refused.exit_code == 1 and "no_such_schema_here" in refused.output, refused.output
    found = runner.invoke(app, ["show", first, "--json", "--schema", filled.schema], env=env)
    assert found.exit_code == 0 and json.loads(found.stdout)["id"] == first, found.output


def test_piped_without_columns_is_80_wide(filled: Filled) -> None:
    """A real `flowlock list` piped to a file, no COLUMNS and no terminal: 80 columns (the
    blocks, not a table); with COLUMNS=200, the table."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "COLUMNS" and not (k.startswith("FLOWLOCK_") and not k.startswith("FLOWLOCK_TEST"))
    }
    src = str(Path(flowlock.__file__).resolve().parents[1])
    env.update(
        FLOWLOCK_DATABASE_URL=filled.url,
        FLOWLOCK_SCHEMA=filled.schema,
        PYTHONPATH=src,
        TERM="xterm",
    )

    def piped(**extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "flowlock", "list"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    narrow = piped()
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    assert "│" not in narrow and all(iid in narrow for iid in filled.ids), narrow
    wide = piped(COLUMNS="200")
    assert "│" in wide and max(len(line) for line in wide.splitlines()) > 80, wide


def test_db_migrate_reads_the_schema_from_the_environment(pg_url: str, pg_schema: str) -> None:
    """`flowlock db migrate` with FLOWLOCK_SCHEMA and no --schema puts the tables there, where
    `list` (with the same variable) then reads them."""
    env = {"FLOWLOCK_DATABASE_URL": pg_url, "FLOWLOCK_SCHEMA": pg_schema}
    migrated = CliRunner().invoke(app, ["db", "migrate"], env=env)
    assert migrated.exit_code == 0, migrated.output
    assert f"(schema {pg_schema})" in migrated.output, migrated.output
    listed = CliRunner().invoke(app, ["list", "--json"], env=env)
    assert listed.exit_code == 0 and json.loads(listed.stdout) == [], listed.output
