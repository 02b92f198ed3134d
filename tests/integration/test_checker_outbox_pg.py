"""The checker's outbox rules on PostgreSQL: a run under the distributed strategy (advisory
locks, so every message carries its transition's fencing token), its deliveries and their Thens
fed back under the message keys, reads clean through `flowlock check`'s reader; then each rule
is broken with SQL in the database and found, naming the message. The engine's dispatcher
delivers, so the rules also hold what it really writes.

On PostgreSQL the key is not stored (it is the primary key written out), so a message under
another key cannot be written there: `message-key` is held by the unit tests (memory) and
SQLite's CLI test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock._inspect import check_instances
from flowlock.checker import EARLY_THEN, ORPHAN_MESSAGE, UNDELIVERED_DONE
from lock_probes import wait_until


def _reserve(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    return flowlock.Step(
        {**inst.data, "qty": payload["qty"]},
        emit=[flowlock.Emit("charge", {"qty": payload["qty"]}), flowlock.Emit("audit", {})],
    )


ORDER = flowlock.Workflow(
    "order",
    states=["new", "reserved", "charged", "shipped"],
    initial="new",
    transitions=[
        flowlock.Transition("reserve", source="new", target="reserved", effect=_reserve),
        flowlock.Transition(
            "charged",
            source="reserved",
            target="charged",
            emit=lambda inst, payload, actor: [flowlock.Emit("ship", {"id": inst.id})],
        ),
        flowlock.Transition("shipped", source="charged", target="shipped"),
    ],
)
IDS = ("o-1", "o-2", "o-3")
BOUND = 30.0  # the most the fill waits for the deliveries (a loaded machine is slow)


async def _charge(message: flowlock.Message) -> flowlock.Then:
    return flowlock.Then("charged")


async def _ship(message: flowlock.Message) -> flowlock.Then:
    return flowlock.Then("shipped")


async def _audit(message: flowlock.Message) -> None:
    return None


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[flowlock.Engine]:
    """An engine on a schema of its own whose transitions hold an advisory lock (a fencing
    token each), filled by its dispatcher: every order reserved, then charged and shipped by
    the Thens of its messages' handlers, every message done."""
    async with flowlock.Engine.connect(
        pg_url, schema=pg_schema, locks="advisory", strategy="distributed", timers=False
    ) as opened:
        await opened.register(ORDER)
        for kind, handler in (("charge", _charge), ("audit", _audit), ("ship", _ship)):
            opened.on_emit(kind, handler)
        for iid in IDS:
            await opened.create("order", instance_id=iid)
            await opened.fire(iid, "reserve", payload={"qty": 2})

        async def delivered() -> bool:
            found = await opened.find_messages(limit=100)
            return len(found) == 3 * len(IDS) and all(m.status == "done" for m in found)

        await wait_until(delivered, within=BOUND, what="every message delivered")
        yield opened


async def _sql(url: str, schema: str, sql: str) -> None:
    conn = await pg_budget.connect(url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        await conn.execute(sql)
    finally:
        await conn.close()


async def test_a_delivered_run_with_fencing_tokens_is_clean(engine: flowlock.Engine) -> None:
    """Every message carries its transition's fencing token, is done after one attempt, and
    each Then follows the message it answers: clean, 9 messages read."""
    messages = await engine.messages("o-1")
    history = {e.version: e for e in await engine.history("o-1")}
    assert [(m.key, m.status, m.attempts) for m in messages] == [
        ("o-1:2:0", "done", 1),
        ("o-1:2:1", "done", 1),
        ("o-1:3:0", "done", 1),
    ]
    assert all(m.fencing_token is not None for m in messages)
    assert [m.fencing_token for m in messages] == [
        history[m.version].fencing_token for m in messages
    ]
    assert [history[v].request_id for v in (3, 4)] == ["o-1:2:0", "o-1:3:0"]
    report = await check_instances(engine, None)
    assert report.verdict.ok, report.verdict.describe()
    assert (report.instances, report.rows, report.messages) == (3, 9, 9)


async def test_messages_broken_in_the_database_are_found(
    engine: flowlock.Engine, pg_url: str, pg_schema: str
) -> None:
    """With SQL: o-1's charge carries another fencing token than its transition, o-2's audit
    is done with no attempt, o-3's reserve row is rewritten under its own message's key, a
    message sits at o-3's version 7 (no transition there) and one belongs to no instance (of a
    kind no handler takes, so the running dispatcher leaves them be). Each is reported once, as
    its kind, at its version."""
    for sql in (
        "UPDATE flowlock_outbox SET fencing_token = fencing_token + 1000 "
        "WHERE instance_id = 'o-1' AND version = 2 AND n = 0",
        "UPDATE flowlock_outbox SET attempts = 0 "
        "WHERE instance_id = 'o-2' AND version = 2 AND n = 1",
        "UPDATE flowlock_history SET request_id = 'o-3:2:1' "
        "WHERE instance_id = 'o-3' AND version = 2",
        "INSERT INTO flowlock_outbox (instance_id, version, n, workflow, kind, payload) "
        "VALUES ('o-3', 7, 0, 'order', 'lost', '{}'), ('nobody', 2, 0, 'order', 'lost', '{}')",
    ):
        await _sql(pg_url, pg_schema, sql)
    report = await check_instances(engine, None)
    found = sorted((v.kind, v.version) for v in report.verdict.violations)
    assert found == [
        (EARLY_THEN, 2),
        (ORPHAN_MESSAGE, 2),
        (ORPHAN_MESSAGE, 2),
        (ORPHAN_MESSAGE, 7),
        (UNDELIVERED_DONE, 2),
    ]
    text = "\n".join(v.message for v in report.verdict.violations)
    assert "'o-1:2:0'" in text and "fencing token" in text
    assert "'nobody', which does not exist" in text
    assert "'o-2:2:1'" in text and "0 attempts" in text
    assert "message 'o-3:2:1'" in text and "'o-3:7:0'" in text
