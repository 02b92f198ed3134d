"""Inspection commands (`flowlock show`, `history`, `list`, `check`) against a database the test
fills through the engine, on PostgreSQL (a schema of its own) and on a SQLite file.

Each test fills the database with the seed's workflows, runs the commands as a user would (typer's
runner, the URL given by option or environment), and reads their JSON or text back. `check` is
run on the clean database and again after a history row is deleted with SQL.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import flowlock
import flowlock._inspect
import pg_budget
from flowlock import examples
from flowlock.cli import EXIT_VERDICT_FAILED, app


@dataclass(frozen=True)
class Db:
    """A database for the commands: its URL, the --schema to pass, and how to run SQL on it."""

    kind: str
    url: str
    schema: str | None

    @classmethod
    def of(cls, request: pytest.FixtureRequest, tmp_path: Path) -> Db:
        """The database of a fixture parametrized "sqlite" / "postgres" (not yet migrated)."""
        if request.param == "sqlite":
            return cls("sqlite", f"sqlite:///{tmp_path / 'flowlock.db'}", None)
        url, schema = request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema")
        return cls("postgres", url, schema)

    @property
    def args(self) -> list[str]:
        return ["--database-url", self.url, *(["--schema", self.schema] if self.schema else [])]

    def execute(self, sql: str) -> None:
        """Run one statement behind flowlock's back (to corrupt what it wrote)."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.url.removeprefix("sqlite:///"))
            try:
                conn.execute(sql)
                conn.commit()
            finally:
                conn.close()
            return

        async def run() -> None:
            conn = await pg_budget.connect(self.url)
            try:
                await conn.execute(f'SET search_path TO "{self.schema}"')
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(run())


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    """A database (not yet migrated) on each backend the inspection commands read."""
    return Db.of(request, tmp_path)


async def _fill(db: Db) -> None:
    """Two approvals (one approved by ann), an inventory with three transitions, and five
    pending tickets (an approval under another name) to page through."""
    async with flowlock.Engine.connect(db.url, schema=db.schema) as engine:
        for wf in (examples.approval(), examples.approval("ticket"), examples.inventory()):
            await engine.register(wf)
        await engine.create("approval", instance_id="a1", data={"title": "[bold]laptop"})
        await engine.create("approval", instance_id="a2")
        await engine.fire("a1", "approve", actor="ann", request_id="req-1")
        await engine.create("inventory", instance_id="i1", data={"stock": 2, "reserved": 0})
        await engine.fire("i1", "reserve", actor="bob", payload={"qty": 2})
        await engine.fire("i1", "restock", payload={"qty": 5})
        await engine.fire("i1", "reserve", payload={"qty": 1})
        for n in range(5):
            await engine.create("ticket", instance_id=f"t{n}")


@pytest.fixture
def db(empty_db: Db) -> Db:
    """The database filled by :func:`_fill`."""
    asyncio.run(_fill(empty_db))
    return empty_db


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    return CliRunner()


def _run(cli: CliRunner, db: Db, *args: str) -> Result:
    result = cli.invoke(app, [*args, *db.args])
    assert "Traceback" not in result.output, result.output
    return result


def _json(result: Result) -> object:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_show_prints_the_instance(cli: CliRunner, db: Db) -> None:
    """show --json is the stored instance; the table names its state, version and data."""
    shown = _json(_run(cli, db, "show", "i1", "--json"))
    assert isinstance(shown, dict)
    assert shown["id"] == "i1"
    assert shown["workflow"] == "inventory"
    assert shown["state"] == "open"
    assert shown["version"] == 4
    assert shown["data"] == {"stock": 4, "reserved": 3}
    assert shown["last_event"] == "reserve"
    assert shown["created_at"] <= shown["updated_at"]

    table = _run(cli, db, "show", "a1")
    assert table.exit_code == 0, table.output
    assert "approved" in table.stdout
    assert "[bold]laptop" in table.stdout  # the user's text is printed as it is, not as markup


def test_history_lists_every_transition(cli: CliRunner, db: Db) -> None:
    """history --json holds one row per applied transition, oldest first, with who and why."""
    rows = _json(_run(cli, db, "history", "i1", "--json"))
    assert isinstance(rows, list)
    assert [(r["version"], r["event"], r["from_state"], r["to_state"]) for r in rows] == [
        (2, "reserve", "open", "open"),
        (3, "restock", "open", "open"),
        (4, "reserve", "open", "open"),
    ]
    assert rows[0]["actor"] == "bob"
    assert rows[0]["payload"] == {"qty": 2}
    assert rows[0]["strategy"] == "pessimistic"
    assert rows[-1]["data"] == {"stock": 4, "reserved": 3}

    table = _run(cli, db, "history", "a1")
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())
    for expected in ("approve", "pending -> approved", "ann", "req-1", "optimistic"):
        assert expected in text

    empty = _json(_run(cli, db, "history", "a2", "--json"))
    assert empty == []


REASON = (
    "stuck since the payment outage of Tuesday: the provider confirmed the charge by phone, "
    "ticket OPS-4411"
)


def test_show_and_history_name_pauses_kinds_and_reasons(cli: CliRunner, db: Db) -> None:
    """The text output says what --json says: show whether the instance (and its workflow) is
    paused; history each row's kind and an operator's reason, wrapped at spaces at 80
    columns."""

    async def repair() -> None:
        async with flowlock.Engine.connect(db.url, schema=db.schema) as engine:
            await engine.register(examples.approval())
            await engine.force("a2", "approved", reason=REASON, actor="ops")
            await engine.pause("a2", reason="audit", actor="ops")
            await engine.pause(workflow="approval", reason="freeze", actor="ops")

    plain = " ".join(_run(cli, db, "show", "a1").stdout.split())
    assert "paused no" in plain and "workflow paused no" in plain
    asyncio.run(repair())
    shown = _run(cli, db, "show", "a2")
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "paused yes" in lines and "workflow paused yes" in lines
    outputs = {}
    for columns in ("80", "200"):
        table = cli.invoke(app, ["history", "a2", *db.args], env={"COLUMNS": columns})
        assert table.exit_code == 0, table.output
        outputs[columns] = out = table.stdout
        assert max(len(line) for line in out.splitlines()) <= int(columns), out
        assert set(REASON.split()) <= set(out.split()), out  # every word of it, whole
    narrow, wide = outputs["80"], outputs["200"]
    # At 80 columns one block per row: its kind and its reason on their own lines.
    kinds = [line.split()[1] for line in narrow.splitlines() if line.startswith("kind ")]
    assert kinds == ["forced", "pause"], narrow
    reasons = [line.split(None, 1)[1] for line in narrow.splitlines() if line.startswith("reason ")]
    assert reasons[1] == "audit" and REASON.startswith(reasons[0]), narrow
    # At 200 a table with both columns.
    header = next(line for line in wide.splitlines() if "version" in line)
    assert "kind" in header and "reason" in header, wide
    rows = [line for line in wide.splitlines() if "flowlock:" in line]
    assert "forced" in rows[0] and "pause" in rows[1] and "audit" in rows[1], wide


@pytest.mark.parametrize("command", ["show", "history"])
def test_unknown_instance_is_one_error_line(cli: CliRunner, db: Db, command: str) -> None:
    result = _run(cli, db, command, "nobody")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "'nobody'" in lines[0]


def test_list_filters_and_walks_pages(
    cli: CliRunner, db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """list walks the pages (two instances a page here) in id order up to --limit."""
    monkeypatch.setattr(flowlock._inspect, "_PAGE", 2)

    every = _json(_run(cli, db, "list", "--json"))
    assert isinstance(every, list)
    assert [i["id"] for i in every] == ["a1", "a2", "i1", "t0", "t1", "t2", "t3", "t4"]

    pending = _json(_run(cli, db, "list", "--state", "pending", "--state", "approved", "--json"))
    assert isinstance(pending, list)
    assert [i["id"] for i in pending] == ["a1", "a2", "t0", "t1", "t2", "t3", "t4"]

    approvals = _json(_run(cli, db, "list", "--workflow", "approval", "-s", "pending", "--json"))
    assert isinstance(approvals, list)
    assert [(i["id"], i["state"]) for i in approvals] == [("a2", "pending")]

    limited = _run(cli, db, "list", "--workflow", "ticket", "--limit", "3", "--json")
    shown = _json(limited)
    assert isinstance(shown, list)
    assert [i["id"] for i in shown] == ["t0", "t1", "t2"]
    assert "2 more match" in limited.stderr

    table = _run(cli, db, "list", "--workflow", "inventory")
    assert table.exit_code == 0, table.output
    assert "1 of 1 instance(s)" in table.stdout
    assert "i1" in table.stdout


def test_check_is_clean_then_names_a_corrupted_history(
    cli: CliRunner, db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check exits 0 on what the engine wrote; after one history row is deleted behind its back
    it exits 3 and names the gap and the instance, while another instance still checks clean."""
    monkeypatch.setattr(flowlock._inspect, "_PAGE", 3)  # every instance, over several pages

    clean = _run(cli, db, "check")
    assert clean.exit_code == 0, clean.output
    assert "checked 8 instance(s), 4 history row(s): clean" in " ".join(clean.stdout.split())

    db.execute("DELETE FROM flowlock_history WHERE instance_id = 'i1' AND version = 3")

    dirty = _run(cli, db, "check")
    assert dirty.exit_code == EXIT_VERDICT_FAILED, dirty.output
    text = " ".join(dirty.stdout.split())
    assert "version-gap: instance 'i1': version 3 missing from history" in text
    assert "final-mismatch" in text
    assert "2 violation(s)" in text  # both are reported, not only the first

    verdict = _json_exit(_run(cli, db, "check", "--json"), EXIT_VERDICT_FAILED)
    assert verdict["ok"] is False
    assert verdict["instances"] == 8
    violations = verdict["violations"]
    assert isinstance(violations, list)
    assert {v["kind"] for v in violations} == {"version-gap", "final-mismatch"}

    one = _run(cli, db, "check", "--instance", "a1")
    assert one.exit_code == 0, one.output
    assert "checked 1 instance(s), 1 history row(s): clean" in " ".join(one.stdout.split())
    assert _run(cli, db, "check", "--instance", "i1").exit_code == EXIT_VERDICT_FAILED
    missing = _run(cli, db, "check", "--instance", "nobody")
    assert missing.exit_code == 1 and "'nobody'" in missing.stderr


def _json_exit(result: Result, code: int) -> dict[str, object]:
    assert result.exit_code == code, result.output
    value = json.loads(result.stdout)
    assert isinstance(value, dict)
    return value


def test_url_from_the_environment(cli: CliRunner, db: Db, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWLOCK_DATABASE_URL", db.url)
    schema = ["--schema", db.schema] if db.schema else []
    result = cli.invoke(app, ["show", "a2", "--json", *schema])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state"] == "pending"


def test_unmigrated_database_is_refused_and_left_alone(cli: CliRunner, empty_db: Db) -> None:
    """Without flowlock's tables every command says to run db migrate, and creates nothing: no
    SQLite file, no PostgreSQL schema."""
    for command in (["show", "x"], ["history", "x"], ["list"], ["check"]):
        result = _run(cli, empty_db, *command)
        assert result.exit_code == 1, result.output
        assert "flowlock db migrate" in result.stderr, result.stderr
    if empty_db.kind == "sqlite":
        assert not Path(empty_db.url.removeprefix("sqlite:///")).exists()
        return

    async def schema_exists() -> bool:
        conn = await pg_budget.connect(empty_db.url)
        try:
            found = await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", empty_db.schema
            )
            return bool(found)
        finally:
            await conn.close()

    assert not asyncio.run(schema_exists())


def test_empty_sqlite_file_is_refused(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    sqlite3.connect(path).close()
    result = cli.invoke(app, ["list", "--database-url", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    assert "no flowlock tables" in result.stderr and "flowlock db migrate" in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "mentions"),
    [
        (["list"], 2, "FLOWLOCK_DATABASE_URL"),
        (["show"], 2, "Missing argument"),
        (["list", "--database-url", "sqlite:///x.db", "--limit", "0"], 2, "--limit"),
        (["list", "--database-url", "memory://"], 1, "unsupported database url"),
        (["list", "--database-url", "mysql://u:secret@h/db"], 1, "unsupported database url"),
        (["list", "--database-url", "sqlite:///x.db", "--schema", "s"], 1, "PostgreSQL only"),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(
    cli: CliRunner, args: list[str], code: int, mentions: str
) -> None:
    result = cli.invoke(app, args)
    assert result.exit_code == code, result.output
    assert mentions in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert "secret" not in result.output


def test_bad_schema_name_is_refused(cli: CliRunner, pg_url: str) -> None:
    result = cli.invoke(app, ["list", "--database-url", pg_url, "--schema", "Bad-Name"])
    assert result.exit_code == 1, result.output
    assert "lower-case SQL identifier" in result.stderr


async def test_check_while_transitions_land_stays_clean(cli: CliRunner, db: Db) -> None:
    """check reads a live database: an engine keeps firing on the instance checked, and no
    transition landing between check's reads of the instance and its history is taken for a
    violation. The churn's own history is then checked whole, after it stopped."""
    stop = asyncio.Event()
    started = asyncio.Event()

    async def churn() -> int:
        fired = 0
        async with flowlock.Engine.connect(db.url, schema=db.schema) as engine:
            await engine.register(examples.inventory())
            while not stop.is_set():
                await engine.fire("i1", "restock", payload={"qty": 1})
                fired += 1
                started.set()
        return fired

    task = asyncio.create_task(churn())
    results: list[Result] = []
    try:
        await asyncio.wait_for(started.wait(), timeout=30)
        for args in (["check", "--instance", "i1"], ["check"]) * 3:
            results.append(await asyncio.to_thread(cli.invoke, app, [*args, *db.args]))
    finally:
        stop.set()
        fired = await task
    assert fired > 0
    for result in results:
        assert result.exit_code == 0, result.output
    after = await asyncio.to_thread(cli.invoke, app, ["check", "--json", *db.args])
    verdict = _json_exit(after, 0)
    assert verdict["ok"] is True and verdict["unsettled"] == []
    assert verdict["rows"] == 4 + fired
