"""The checker's outbox rules: every message belongs to a transition in its instance's history
(same version, same fencing token) under its own key, none is done without an attempt, and a
row fired under a message's key (its handler's Then) comes after the transition that emitted
it. Hand-built histories break each rule; a real run on the memory store stays clean, and
messages broken inside the store are found by `flowlock check`'s reader."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

import flowlock
from flowlock._inspect import check_instances
from flowlock.checker import (
    DOUBLE_APPLY,
    EARLY_THEN,
    KINDS,
    MESSAGE_KEY,
    ORPHAN_MESSAGE,
    UNDELIVERED_DONE,
    check,
    check_many,
)
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import Message, MessageStatus, message_key
from flowlock.stores import MemoryStore
from lock_probes import wait_until

ID = "a"
BOUND = 20.0  # the most a test waits for a delivery (a loaded machine is slow)


def _row(
    version: int,
    event: str,
    move: tuple[str, str],
    *,
    request_id: str | None = None,
    fencing_token: int | None = None,
) -> HistoryEntry:
    return HistoryEntry(
        instance_id=ID,
        version=version,
        event=event,
        from_state=move[0],
        to_state=move[1],
        actor=None,
        request_id=request_id,
        strategy="optimistic",
        data={},
        fencing_token=fencing_token,
    )


def _instance(rows: list[HistoryEntry]) -> Instance:
    last = rows[-1]
    return Instance(ID, "order", last.to_state, last.version, {}, last.event)


def _message(
    version: int,
    n: int = 0,
    *,
    status: MessageStatus = "pending",
    attempts: int = 0,
    key: str | None = None,
    instance_id: str = ID,
    fencing_token: int | None = None,
) -> Message:
    return Message(
        key=key if key is not None else message_key(instance_id, version, n),
        instance_id=instance_id,
        workflow="order",
        version=version,
        n=n,
        kind="notify",
        payload={},
        status=status,
        attempts=attempts,
        fencing_token=fencing_token,
    )


ROWS = [
    _row(2, "reserve", ("new", "reserved")),
    _row(3, "confirm", ("reserved", "confirmed"), request_id="a:2:0"),
    _row(4, "ship", ("confirmed", "shipped"), request_id="a:3:1"),
]


def test_the_new_kinds_are_listed() -> None:
    """The four outbox kinds are among the exactly-once check's kinds."""
    assert {ORPHAN_MESSAGE, MESSAGE_KEY, UNDELIVERED_DONE, EARLY_THEN} <= set(KINDS)


def test_messages_of_the_history_delivered_and_fed_back_are_clean() -> None:
    """Messages at versions the history holds, under their keys, done after an attempt, dead or
    pending; each Then after the version that emitted its message: clean. Without messages
    read, nothing of the outbox is checked."""
    messages = [
        _message(2, status="done", attempts=1),
        _message(2, 1, status="dead", attempts=10),
        _message(3, 0, status="running", attempts=2),
        _message(3, 1, status="done", attempts=3),
        _message(4, status="pending"),
    ]
    verdict = check(_instance(ROWS), ROWS, initial_state="new", messages=messages)
    assert verdict.ok, verdict.describe()
    assert check(_instance(ROWS), ROWS, messages=[]).ok
    assert check(_instance(ROWS), ROWS).ok


def test_a_message_with_no_transition_at_its_version_is_an_orphan() -> None:
    """A message of a version past the history (a lost compare-and-swap that kept its
    messages), and one of version 1 (a create emits nothing, and has no row): orphan-message,
    naming the key, the version and where the instance is."""
    ahead = _message(5)
    created = _message(1)
    verdict = check(_instance(ROWS), ROWS, messages=[ahead, created])
    assert verdict.kinds() == {ORPHAN_MESSAGE}
    assert [v.version for v in verdict.violations] == [5, 1]
    first = verdict.violations[0].message
    assert "'a:5:0'" in first and "no transition at that version" in first
    assert "the instance is at version 4" in first


def test_a_message_under_another_fencing_token_is_an_orphan() -> None:
    """The transition at version 2 was written under token 7; a message of it carrying 6 was
    written by another transaction: orphan-message naming both tokens."""
    rows = [_row(2, "reserve", ("new", "reserved"), fencing_token=7)]
    assert check(_instance(rows), rows, messages=[_message(2, fencing_token=7)]).ok
    verdict = check(_instance(rows), rows, messages=[_message(2, fencing_token=6)])
    assert verdict.kinds() == {ORPHAN_MESSAGE}
    message = verdict.violations[0].message
    assert "fencing token 6" in message and "written under 7" in message


def test_a_message_under_another_key_is_a_violation() -> None:
    """A key that is not <instance>:<version>:<n> of its own transition (another n, another
    version, no key at all), and a message of another instance in the list: message-key."""
    verdict = check(
        _instance(ROWS),
        ROWS,
        messages=[
            _message(2, 0, key="a:2:1"),
            _message(3, key="a:4:0"),
            _message(4, key="notify-1"),
            _message(2, instance_id="b"),
        ],
    )
    assert verdict.kinds() == {MESSAGE_KEY}
    assert len(verdict.violations) == 4
    assert "its key must be 'a:2:0'" in verdict.violations[0].message
    assert "of instance 'b'" in verdict.violations[3].message


def test_a_done_message_never_attempted_is_a_violation() -> None:
    """Done after 0 attempts: undelivered-done; dead or pending after 0 are fine (a retried
    message starts again from 0)."""
    verdict = check(
        _instance(ROWS),
        ROWS,
        messages=[
            _message(2, status="done", attempts=0),
            _message(3, status="pending", attempts=0),
            _message(4, status="dead", attempts=0),
        ],
    )
    assert verdict.kinds() == {UNDELIVERED_DONE}
    (violation,) = verdict.violations
    assert violation.version == 2 and "'a:2:0'" in violation.message


def test_a_then_at_or_before_its_messages_version_is_a_violation() -> None:
    """Rows fired under the key of a message emitted at their own version, or later: early-then,
    naming the row and the message. A request id that only looks like a key (no such message
    read) is left alone."""
    rows = [
        _row(2, "reserve", ("new", "reserved"), request_id="a:2:0"),
        _row(3, "confirm", ("reserved", "confirmed"), request_id="a:4:0"),
        _row(4, "ship", ("confirmed", "shipped"), request_id="a:9:0"),
    ]
    verdict = check(_instance(rows), rows, messages=[_message(2), _message(4)])
    assert verdict.kinds() == {EARLY_THEN}
    assert [v.version for v in verdict.violations] == [2, 3]
    assert "message 'a:4:0'" in verdict.violations[1].message
    assert "the transition at version 4 emitted" in verdict.violations[1].message


def test_a_then_applied_twice_is_a_double_apply() -> None:
    """Two rows under one message's key: the Then fed back twice is a repeated request id."""
    rows = [*ROWS, _row(5, "confirm", ("shipped", "shipped"), request_id="a:2:0")]
    verdict = check(_instance(rows), rows, messages=[_message(2)])
    assert verdict.kinds() == {DOUBLE_APPLY}
    assert "request 'a:2:0' applied again at version 5" in verdict.violations[0].message


def test_check_many_takes_each_instances_messages() -> None:
    """check_many checks the messages given for an instance, and none for one left out."""
    inst = _instance(ROWS)
    assert check_many([(inst, ROWS)], messages={ID: [_message(9)]}).kinds() == {ORPHAN_MESSAGE}
    assert check_many([(inst, ROWS)], messages={"b": [_message(9)]}).ok


# -- flowlock check's reader on the memory store ----------------------------------------------


def _ship(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[flowlock.Emit]:
    return [flowlock.Emit("warehouse", {"order": inst.id})]


def _reserve(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> flowlock.Step:
    return flowlock.Step(
        dict(inst.data), emit=[flowlock.Emit("payment", {}), flowlock.Emit("audit", {})]
    )


def _orders() -> flowlock.Workflow:
    return flowlock.Workflow(
        "order",
        states=["new", "reserved", "confirmed", "shipped"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", effect=_reserve),
            flowlock.Transition("confirm", source="reserved", target="confirmed"),
            flowlock.Transition("ship", source="confirmed", target="shipped", emit=_ship),
        ],
    )


async def _pay(message: Message) -> flowlock.Then:
    return flowlock.Then("confirm")


async def _until(engine: flowlock.Engine, iid: str, state: str) -> None:
    async def there() -> bool:
        return (await engine.get(iid)).state == state

    await wait_until(there, within=BOUND, what=f"{iid} in {state}")


async def _run(engine: flowlock.Engine, iid: str) -> None:
    """reserve (two messages), the payment delivered by the dispatcher and its Then (confirm)
    fired under its key, then ship (one message, left pending: no handler takes it)."""
    await engine.create("order", instance_id=iid)
    await engine.fire(iid, "reserve")
    await _until(engine, iid, "confirmed")
    await engine.fire(iid, "ship")


def _engine(store: MemoryStore) -> flowlock.Engine:
    engine = flowlock.Engine(store)
    engine.on_emit("payment", _pay)
    return engine


async def test_a_run_with_messages_is_clean() -> None:
    """Emitting transitions, a delivery and its Then pass `flowlock check`'s reader, which
    counts the messages it read."""
    store = MemoryStore()
    async with _engine(store) as engine:
        await engine.register(_orders())
        for iid in ("o-1", "o-2"):
            await _run(engine, iid)
        history = await engine.history("o-1")
        assert [(e.event, e.request_id) for e in history] == [
            ("reserve", None),
            ("confirm", "o-1:2:0"),
            ("ship", None),
        ]
        statuses = [(m.key, m.status) for m in await engine.messages("o-1")]
        assert statuses == [("o-1:2:0", "done"), ("o-1:2:1", "pending"), ("o-1:4:0", "pending")]
        report = await check_instances(engine, None)
        assert report.verdict.ok, report.verdict.describe()
        assert (report.instances, report.rows, report.messages) == (2, 6, 6)
        one = await check_instances(engine, "o-1")
        assert one.verdict.ok and one.messages == 3


def _break(store: MemoryStore, stored: str, **changes: Any) -> None:
    """Change a stored message in place, as a broken store or a hand edit would."""
    held = store._outbox[stored]
    held.message = dataclasses.replace(held.message, **changes)


def _plant(store: MemoryStore, message: Message) -> None:
    """Store a message no commit wrote."""
    like = next(iter(store._outbox.values()))
    store._outbox[message.key] = dataclasses.replace(like, message=message)


async def test_broken_messages_are_caught_by_flowlock_checks_reader() -> None:
    """In the store: a message done without an attempt, one whose key names another n, one
    planted at a version with no transition, one of an instance that does not exist, and a
    reserve row rewritten to carry the key of the message it emitted (a Then at its own
    version). Each is reported once, naming its instance; --instance checks only that
    instance's, and finds no homeless message."""
    store = MemoryStore()
    async with _engine(store) as engine:
        await engine.register(_orders())
        await _run(engine, "o-1")
        await engine.create("order", instance_id="o-2")
        await engine.fire("o-2", "reserve")
        await _until(engine, "o-2", "confirmed")
        _break(store, "o-1:2:1", status="done")  # audit: done, never attempted
        _break(store, "o-1:4:0", key="o-1:4:7")  # a key that is not its own
        _plant(store, _message(9, instance_id="o-1"))  # no transition at version 9
        _plant(store, _message(2, instance_id="gone"))  # no such instance
        rows = store._history["o-2"]
        rows[0] = dataclasses.replace(rows[0], request_id="o-2:2:1")  # reserve, under its audit

        report = await check_instances(engine, None)
        found = sorted((v.kind, v.version) for v in report.verdict.violations)
        assert found == [
            (EARLY_THEN, 2),
            (MESSAGE_KEY, 4),
            (ORPHAN_MESSAGE, 2),
            (ORPHAN_MESSAGE, 9),
            (UNDELIVERED_DONE, 2),
        ]
        texts = {v.kind + str(v.version): v.message for v in report.verdict.violations}
        assert "'gone', which does not exist" in texts[ORPHAN_MESSAGE + "2"]
        assert "instance 'o-1'" in texts[UNDELIVERED_DONE + "2"]
        assert "instance 'o-2'" in texts[EARLY_THEN + "2"]
        assert "message 'o-2:2:1'" in texts[EARLY_THEN + "2"]

        only = await check_instances(engine, "o-1")
        assert sorted(v.kind for v in only.verdict.violations) == [
            MESSAGE_KEY, ORPHAN_MESSAGE, UNDELIVERED_DONE
        ]  # fmt: skip


@pytest.mark.parametrize("kind", [ORPHAN_MESSAGE, MESSAGE_KEY, UNDELIVERED_DONE, EARLY_THEN])
def test_each_kind_reads_as_words(kind: str) -> None:
    """Kinds are lower-case words joined by '-', as the other kinds are."""
    assert kind == kind.lower() and " " not in kind and kind.replace("-", "").isalpha()
