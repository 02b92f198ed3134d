"""`flowlock outbox list|retry|drop` and `flowlock check`'s outbox rules on a database the test
fills through the engine, on PostgreSQL (a schema of its own) and on a SQLite file.

The filling engine registers no handler, so nothing is delivered by itself: the test moves a
message to dead and another to done through the store's own claim, fail and finish, as a
dispatcher would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from test_inspect_cli import Db
from typer.testing import CliRunner, Result

import flowlock
from flowlock.cli import EXIT_VERDICT_FAILED, app
from flowlock.stores.base import OutboxStore

NOTES = 9  # p's notes: versions 3..11, so its keys sort p:10:0, p:11:0, p:2:0, ... by key


def _reserve(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    return flowlock.Step(
        dict(inst.data),
        emit=[flowlock.Emit("charge", {"amount": 30}), flowlock.Emit("audit", {"by": actor})],
    )


ORDER = flowlock.Workflow(
    "order",
    states=["new", "reserved", "charged"],
    initial="new",
    transitions=[
        flowlock.Transition("reserve", source="new", target="reserved", effect=_reserve),
        flowlock.Transition(
            "note",
            source="reserved",
            target="reserved",
            emit=lambda inst, payload, actor: [flowlock.Emit("audit", {"v": inst.version})],
        ),
        flowlock.Transition("charged", source="reserved", target="charged"),
    ],
)


async def _fill(db: Db) -> None:
    """o-1's charge dead (a 400) and its audit done; o-2's two messages pending; p with a
    charge, an audit and NOTES more audits, all pending. 15 messages: 13 pending, 1 done,
    1 dead."""
    async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
        await engine.register(ORDER)
        store = engine.store
        assert isinstance(store, OutboxStore)
        await engine.create("order", instance_id="o-1")
        await engine.fire("o-1", "reserve", actor="ann")
        [charge] = await store.claim_messages({"charge": 1}, lease=30.0, owner="test")
        assert await store.fail_message(charge, "test", "HTTP 400: card declined", None)
        [audit] = await store.claim_messages({"audit": 1}, lease=30.0, owner="test")
        assert audit.key == "o-1:2:1"
        assert await store.finish_messages([audit.key]) == 1
        await engine.create("order", instance_id="o-2")
        await engine.fire("o-2", "reserve", actor="bob")
        await engine.create("order", instance_id="p")
        await engine.fire("p", "reserve")
        for _ in range(NOTES):
            await engine.fire("p", "note")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    """A filled database on each backend the outbox commands open."""
    found = Db.of(request, tmp_path)
    asyncio.run(_fill(found))
    return found


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    return CliRunner()


def _run(cli: CliRunner, db: Db, *args: str, answer: str | None = None) -> Result:
    result = cli.invoke(app, [*args, *db.args], input=answer)
    assert "Traceback" not in result.output, result.output
    return result


def _listed(cli: CliRunner, db: Db, *args: str) -> dict[str, Any]:
    result = _run(cli, db, "outbox", "list", "--json", *args)
    assert result.exit_code == 0, result.output
    value = json.loads(result.stdout)
    assert isinstance(value, dict)
    return value


def _keys(listed: dict[str, Any]) -> list[str]:
    return [m["key"] for m in listed["messages"]]


def _text(result: Result) -> str:
    return " ".join(result.output.split())


P_KEYS = ["p:2:0", "p:2:1", *(f"p:{v}:0" for v in range(3, 3 + NOTES))]
ALL_KEYS = ["o-1:2:0", "o-1:2:1", "o-2:2:0", "o-2:2:1", *P_KEYS]  # message order


def test_list_shows_every_message_in_order_with_the_counts(cli: CliRunner, db: Db) -> None:
    """--json: the counts by status, every message in order (instance id, then version as a
    number: p:2:0 before p:10:0) with its fields, no next page; the dead one with its error and
    attempt."""
    listed = _listed(cli, db)
    assert listed["counts"] == {"pending": 13, "running": 0, "done": 1, "dead": 1}
    assert _keys(listed) == ALL_KEYS
    assert listed["next_after"] is None
    by_key = {m["key"]: m for m in listed["messages"]}
    dead = by_key["o-1:2:0"]
    assert (dead["status"], dead["attempts"], dead["last_error"]) == (
        "dead", 1, "HTTP 400: card declined"
    )  # fmt: skip
    assert (dead["kind"], dead["instance_id"], dead["workflow"], dead["version"], dead["n"]) == (
        "charge", "o-1", "order", 2, 0
    )  # fmt: skip
    assert dead["payload"] == {"amount": 30} and dead["next_attempt_at"] is None
    done = by_key["o-1:2:1"]
    assert (done["status"], done["attempts"], done["payload"]) == ("done", 1, {"by": "ann"})
    assert done["done_at"] is not None and done["done_at"] >= done["created_at"]
    waiting = by_key["o-2:2:0"]
    assert (waiting["status"], waiting["attempts"]) == ("pending", 0)
    assert waiting["next_attempt_at"] is not None


def test_list_filters_by_status_and_kind(cli: CliRunner, db: Db) -> None:
    """--status and --kind each narrow the list, and together."""
    assert _keys(_listed(cli, db, "--status", "dead")) == ["o-1:2:0"]
    assert _keys(_listed(cli, db, "--status", "done")) == ["o-1:2:1"]
    assert _keys(_listed(cli, db, "--status", "running")) == []
    assert _keys(_listed(cli, db, "--kind", "charge")) == ["o-1:2:0", "o-2:2:0", "p:2:0"]
    assert _keys(_listed(cli, db, "--kind", "charge", "-s", "pending")) == ["o-2:2:0", "p:2:0"]


def test_list_pages_with_limit_and_after(cli: CliRunner, db: Db) -> None:
    """A full page names its last key as next_after (and the table says to pass it); the
    pages walk every message once."""
    seen: list[str] = []
    after: list[str] = []
    while True:
        page = _listed(cli, db, "--limit", "4", *after)
        seen += _keys(page)
        if page["next_after"] is None:
            break
        assert page["next_after"] == seen[-1]
        after = ["--after", page["next_after"]]
    assert seen == ALL_KEYS

    table = _run(cli, db, "outbox", "list", "--limit", "4")
    assert table.exit_code == 0, table.output
    assert f"--after '{ALL_KEYS[3]}'" in _text(table)


def test_list_of_one_instance_is_in_emitting_order(cli: CliRunner, db: Db) -> None:
    """--instance lists that instance's messages by version then n (p:2:0 ... p:11:0), pages
    after a key of that instance, and refuses an unknown instance or another's key (exit 1)."""
    assert _keys(_listed(cli, db, "--instance", "p")) == P_KEYS
    assert _keys(_listed(cli, db, "-i", "p", "--after", "p:3:0", "-n", "2")) == ["p:4:0", "p:5:0"]
    assert _keys(_listed(cli, db, "-i", "p", "--kind", "charge")) == ["p:2:0"]
    unknown = _run(cli, db, "outbox", "list", "--instance", "nope")
    assert unknown.exit_code == 1 and "no instance with id 'nope'" in _text(unknown)
    other = _run(cli, db, "outbox", "list", "-i", "p", "--after", "o-1:2:0")
    assert other.exit_code == 1 and "a message of instance 'o-1'" in _text(other)


def test_list_prints_a_table_with_the_counts_in_its_title(cli: CliRunner, db: Db) -> None:
    """The table's title says how many are shown and the counts; rows show key, kind, status,
    attempts and the last error."""
    table = _run(cli, db, "outbox", "list", "--status", "dead")
    assert table.exit_code == 0, table.output
    text = _text(table)
    assert "1 message(s); in all: 13 pending, 0 running, 1 done, 1 dead" in text
    assert "o-1:2:0" in text and "charge" in text and "HTTP 400: card declined" in text


def test_retry_makes_a_dead_message_pending_again(cli: CliRunner, db: Db) -> None:
    """retry: the dead message is pending, due now, attempts 0, its last error kept; a done
    message is refused, an unknown key is an error (exit 1 each), a bad key a usage error."""
    result = _run(cli, db, "outbox", "retry", "o-1:2:0")
    assert result.exit_code == 0, result.output
    assert "message o-1:2:0 (charge) is pending again" in _text(result)
    [again] = _listed(cli, db, "-i", "o-1", "--kind", "charge")["messages"]
    assert (again["status"], again["attempts"]) == ("pending", 0)
    assert again["last_error"] == "HTTP 400: card declined"

    done = _run(cli, db, "outbox", "retry", "o-1:2:1")
    assert done.exit_code == 1 and "delivered already (done)" in _text(done)
    missing = _run(cli, db, "outbox", "retry", "o-9:2:0")
    assert missing.exit_code == 1 and "no outbox message with key 'o-9:2:0'" in _text(missing)
    bad = _run(cli, db, "outbox", "retry", "o-9")
    assert bad.exit_code == 2


def test_retry_leaves_a_message_being_delivered_alone(cli: CliRunner, db: Db) -> None:
    """A message an engine holds (running) is not retried under its delivery: exit 1, saying
    when its claim runs out; nothing changed."""

    async def claim() -> None:
        async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
            store = engine.store
            assert isinstance(store, OutboxStore)
            [held] = await store.claim_messages({"charge": 1}, lease=300.0, owner="other")
            assert held.key == "o-2:2:0"

    asyncio.run(claim())
    result = _run(cli, db, "outbox", "retry", "o-2:2:0")
    assert result.exit_code == 1, result.output
    assert "is being delivered now (its claim runs out at" in _text(result)
    [held] = _listed(cli, db, "-i", "o-2", "--kind", "charge")["messages"]
    assert (held["status"], held["attempts"]) == ("running", 1)


def test_drop_asks_first_unless_yes(cli: CliRunner, db: Db) -> None:
    """drop shows the message and asks: no (or no answer) keeps it, exit 1; yes deletes it;
    --yes deletes without asking; a key already gone is an error (exit 1)."""
    declined = _run(cli, db, "outbox", "drop", "o-2:2:1", answer="n\n")
    assert declined.exit_code == 1, declined.output
    assert "Drop message o-2:2:1?" in declined.output
    assert "not dropped" in _text(declined)
    no_answer = _run(cli, db, "outbox", "drop", "o-2:2:1", answer="")
    assert no_answer.exit_code == 1 and "not dropped" in _text(no_answer)
    assert "o-2:2:1" in _keys(_listed(cli, db, "-i", "o-2"))

    agreed = _run(cli, db, "outbox", "drop", "o-2:2:1", answer="y\n")
    assert agreed.exit_code == 0, agreed.output
    assert "dropped message o-2:2:1" in _text(agreed)
    assert _keys(_listed(cli, db, "-i", "o-2")) == ["o-2:2:0"]

    forced = _run(cli, db, "outbox", "drop", "p:2:0", "--yes")
    assert forced.exit_code == 0 and "Drop message" not in forced.output
    assert "p:2:0" not in _keys(_listed(cli, db, "-i", "p"))
    again = _run(cli, db, "outbox", "drop", "p:2:0", "--yes")
    assert again.exit_code == 1 and "no outbox message with key 'p:2:0'" in _text(again)


def test_check_is_clean_then_finds_messages_broken_in_the_database(cli: CliRunner, db: Db) -> None:
    """check reads every message with its instance: clean, counting them. Then, behind
    flowlock's back: a message marked done with no attempt, one at a version with no
    transition, one of an instance that does not exist, and the reserve row rewritten to
    carry the key of the message it emitted. Each is reported (exit 3), naming its key."""
    clean = _run(cli, db, "check")
    assert clean.exit_code == 0, clean.output
    assert "checked 3 instance(s), 12 history row(s), 15 outbox message(s): clean" in _text(clean)

    db.execute(
        "UPDATE flowlock_outbox SET status = 'done', attempts = 0 "
        "WHERE instance_id = 'o-2' AND version = 2 AND n = 1"
    )
    columns, values = "instance_id, version, n, workflow, kind, payload", "'order', 'x', '{}'"
    if db.kind == "sqlite":  # a stored key (PostgreSQL has none), no server clock
        columns += ", key, due_at, created_at"
        planted = [("o-2", 9, ", 'o-2:9:0', 0, 0"), ("gone", 2, ", 'gone:2:0', 0, 0")]
    else:
        planted = [("o-2", 9, ""), ("gone", 2, "")]
    for iid, version, extra in planted:
        db.execute(
            f"INSERT INTO flowlock_outbox ({columns}) "
            f"VALUES ('{iid}', {version}, 0, {values}{extra})"
        )
    db.execute(
        "UPDATE flowlock_history SET request_id = 'p:2:0' WHERE instance_id = 'p' AND version = 2"
    )

    result = _run(cli, db, "check", "--json")
    assert result.exit_code == EXIT_VERDICT_FAILED, result.output
    verdict = json.loads(result.stdout)
    found = sorted((v["kind"], v["version"]) for v in verdict["violations"])
    assert found == [
        ("early-then", 2),
        ("orphan-message", 2),
        ("orphan-message", 9),
        ("undelivered-done", 2),
    ]
    text = " ".join(v["message"] for v in verdict["violations"])
    assert "'gone', which does not exist" in text and "'o-2:9:0'" in text
    assert "'o-2:2:1'" in text and "message 'p:2:0'" in text
    assert verdict["messages"] == 16  # those read with their instances (not the homeless one)

    one = _run(cli, db, "check", "--instance", "o-2", "--json")
    assert one.exit_code == EXIT_VERDICT_FAILED
    kinds = sorted(v["kind"] for v in json.loads(one.stdout)["violations"])
    assert kinds == ["orphan-message", "undelivered-done"]


def test_the_repairs_refuse_what_they_cannot_open(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing SQLite file is refused, not created; memory:// holds nothing to repair; the
    URL may come from FLOWLOCK_DATABASE_URL. Each an error line, exit 1."""
    missing = tmp_path / "none.db"
    result = cli.invoke(
        app, ["outbox", "retry", "o-1:2:0", "--database-url", f"sqlite:///{missing}"]
    )
    assert result.exit_code == 1 and "no SQLite database" in " ".join(result.output.split())
    assert not missing.exists()
    monkeypatch.setenv("FLOWLOCK_DATABASE_URL", "memory://")
    memory = cli.invoke(app, ["outbox", "drop", "o-1:2:0", "--yes"])
    assert memory.exit_code == 1 and "memory:// holds nothing" in " ".join(memory.output.split())
