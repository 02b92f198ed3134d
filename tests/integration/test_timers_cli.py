"""`flowlock timers`, `flowlock show`'s next timer and `flowlock check`'s timer rules on a database
the test fills through the engine, on PostgreSQL (a schema of its own) and on a SQLite file.

The filling engine runs with timers off, so the quick deadlines come due and stay armed (overdue,
with a lag) until the test starts an engine that fires them.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from test_inspect_cli import Db
from typer.testing import CliRunner, Result

import flowlock
from flowlock.cli import EXIT_VERDICT_FAILED, app
from lock_probes import wait_until

BOUND = 20.0


def _flow(name: str, after: timedelta, every: timedelta | None = None) -> flowlock.Workflow:
    """An approval whose `expire` fires `after` into the stay in pending, and, with `every`, a
    `remind` reminder; `hold` and `back` leave pending and begin a new stay there."""
    transitions = [
        flowlock.Transition("approve", source="pending", target="approved"),
        flowlock.Transition("hold", source="pending", target="review"),
        flowlock.Transition("back", source="review", target="pending"),
        flowlock.Transition("expire", source="pending", target="rejected", after=after),
    ]
    if every is not None:
        transitions.append(
            flowlock.Transition("remind", source="pending", target="pending", every=every)
        )
    return flowlock.Workflow(
        name,
        states=["pending", "review", "approved", "rejected"],
        initial="pending",
        transitions=transitions,
    )


QUICK = _flow("quick", timedelta(milliseconds=100))
SLOW = _flow("slow", timedelta(hours=1), every=timedelta(minutes=30))


async def _fill(db: Db) -> None:
    """d1 and d2 (quick) overdue; s1 (slow) armed for later; c1 (slow) in its second stay in
    pending (begun at version 3). Nothing fires: the engine runs with timers off."""
    async with flowlock.Engine.connect(db.url, schema=db.schema, timers=False) as engine:
        for wf in (QUICK, SLOW):
            await engine.register(wf)
        for iid in ("d1", "d2"):
            await engine.create("quick", instance_id=iid)
        await engine.create("slow", instance_id="s1")
        await engine.create("slow", instance_id="c1")
        await engine.fire("c1", "hold")
        await engine.fire("c1", "back")

        async def overdue() -> bool:
            return all([(await engine.timers(iid))[0].lag > 0 for iid in ("d1", "d2")])

        await wait_until(overdue, within=BOUND, what="d1 and d2 overdue")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    """A filled database on each backend the inspection commands read."""
    found = Db.of(request, tmp_path)
    asyncio.run(_fill(found))
    return found


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("FLOWLOCK_DATABASE_URL", raising=False)
    return CliRunner()


def _run(cli: CliRunner, db: Db, *args: str) -> Result:
    result = cli.invoke(app, [*args, *db.args])
    assert "Traceback" not in result.output, result.output
    return result


def _json(result: Result, code: int = 0) -> dict[str, Any]:
    assert result.exit_code == code, result.output
    value = json.loads(result.stdout)
    assert isinstance(value, dict)
    return value


def test_timers_lists_due_and_overdue_timers_with_their_lag(cli: CliRunner, db: Db) -> None:
    """Due now: the two overdue deadlines, earliest first, each with its lag; within two hours:
    every armed timer (the reminders before the expiries); the count of all armed timers; a
    table whose title says both; show's next timer."""
    due = _json(_run(cli, db, "timers", "--json"))
    assert due["armed"] == 6 and due["within"] == 0
    timers = due["timers"]
    assert isinstance(timers, list)
    assert [(t["instance_id"], t["event"], t["stay"], t["n"]) for t in timers] == [
        ("d1", "expire", 1, 0),
        ("d2", "expire", 1, 0),
    ]
    assert all(t["lag"] > 0 and t["workflow"] == "quick" for t in timers)
    assert timers[0]["due_at"] <= timers[1]["due_at"]

    later = _json(_run(cli, db, "timers", "--within", "7200", "--json"))
    rows = [(t["instance_id"], t["event"], t["stay"]) for t in later["timers"]]
    assert rows == [
        ("d1", "expire", 1),
        ("d2", "expire", 1),
        ("s1", "remind", 1),
        ("c1", "remind", 3),
        ("s1", "expire", 1),
        ("c1", "expire", 3),
    ]

    table = _run(cli, db, "timers", "--limit", "1")
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())
    assert "1 timer(s) due now; 6 armed in all" in text
    assert "d1" in text and "d2" not in text
    assert "raise --limit" in table.stderr

    shown = _json(_run(cli, db, "show", "c1", "--json"))
    remind = later["timers"][3]
    assert shown["next_timer"] == {"event": "remind", "due_at": remind["due_at"], "stay": 3}
    assert "next timer" in _run(cli, db, "show", "c1").stdout


async def test_check_names_a_timer_firing_outside_its_stay(cli: CliRunner, db: Db) -> None:
    """check is clean once an engine fired the overdue deadlines (as the timer); a history row
    made to look like a firing of an ended stay is stale-timer, and a timer moved to an ended
    stay is stray-timer, each naming c1; the other instances still check clean."""
    async with flowlock.Engine.connect(db.url, schema=db.schema) as engine:
        await engine.register(QUICK)

        async def fired() -> bool:
            return all([(await engine.get(iid)).state == "rejected" for iid in ("d1", "d2")])

        await wait_until(fired, within=BOUND, what="the deadlines fired")
        [row] = await engine.history("d1")
        assert (row.actor, row.request_id) == ("flowlock:timer", "timer:1:expire:0")

    clean = await asyncio.to_thread(_run, cli, db, "check")
    assert clean.exit_code == 0, clean.output
    assert "checked 4 instance(s), 4 history row(s): clean" in " ".join(clean.stdout.split())

    # Behind flowlock's back (on its own thread: Db.execute runs its own event loop).
    await asyncio.to_thread(
        db.execute,
        "UPDATE flowlock_history SET actor = 'flowlock:timer', request_id = 'timer:1:back:0' "
        "WHERE instance_id = 'c1' AND version = 3",
    )
    await asyncio.to_thread(
        db.execute,
        "UPDATE flowlock_timers SET stay = 1 WHERE instance_id = 'c1' AND event = 'remind'",
    )
    verdict = _json(await asyncio.to_thread(_run, cli, db, "check", "--json"), EXIT_VERDICT_FAILED)
    violations = verdict["violations"]
    assert isinstance(violations, list)
    assert {v["kind"] for v in violations} == {"stale-timer", "stray-timer"}
    assert all("'c1'" in v["message"] for v in violations)
    one = await asyncio.to_thread(_run, cli, db, "check", "--instance", "s1")
    assert one.exit_code == 0, one.output
