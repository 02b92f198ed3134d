"""The checker's timer rules: a timer's firing applies only in the stay that armed it, and once;
every armed timer belongs to its instance's current stay. Hand-built histories break each rule;
a real run on the memory store (and `flowlock check`'s reader) stays clean."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import flowlock
from flowlock._inspect import check_instances
from flowlock.checker import (
    BROKEN_CHAIN,
    DOUBLE_APPLY,
    STALE_TIMER,
    STRAY_TIMER,
    check,
    check_many,
)
from flowlock.checker.timers import firing_of
from flowlock.core.models import (
    TIMER_ACTOR,
    HistoryEntry,
    Instance,
    Timer,
    TimerFiring,
    timer_request_id,
)
from flowlock.stores import MemoryStore
from lock_probes import wait_until

ID = "a"


def _row(
    version: int,
    event: str,
    move: tuple[str, str],
    *,
    fired: tuple[int, int] | None = None,
    request_id: str | None = None,
) -> HistoryEntry:
    """A history row; `fired=(stay, n)` makes it a timer's firing of `event`."""
    actor = None
    if fired is not None:
        actor, request_id = TIMER_ACTOR, timer_request_id(fired[0], event, fired[1])
    return HistoryEntry(
        instance_id=ID,
        version=version,
        event=event,
        from_state=move[0],
        to_state=move[1],
        actor=actor,
        request_id=request_id,
        strategy="optimistic",
        data={},
    )


def _instance(rows: list[HistoryEntry], stay: int | None) -> Instance:
    """The instance as `rows` leave it, in the stay beginning at `stay`."""
    last = rows[-1]
    return Instance(ID, "approval", last.to_state, last.version, {}, last.event, stay_version=stay)


def _timer(stay: int, event: str = "expire", n: int = 0) -> Timer:
    return Timer(ID, "approval", event, stay, datetime.now(UTC), n)


def test_a_timer_row_is_known_by_its_actor_and_request_id() -> None:
    """Only a row by flowlock:timer under timer:<stay>:<event>:<n> is a timer's firing."""
    assert firing_of(_row(2, "expire", ("p", "r"), fired=(1, 0))) == TimerFiring(1, "expire", 0)
    assert firing_of(_row(2, "remind", ("p", "p"), fired=(12, 3))) == TimerFiring(12, "remind", 3)
    assert firing_of(_row(2, "expire", ("p", "r"), request_id="timer:1:expire:0")) is None
    odd = _row(2, "expire", ("p", "r"), fired=(1, 0))
    for rid in ("timer:x:expire:0", "timer:1:expire", "req-1", None):
        assert firing_of(dataclasses.replace(odd, request_id=rid)) is None


def test_timer_firings_within_their_stays_are_clean() -> None:
    """Reminders keep the stay (pending from version 1 throughout); the expiry of the stay
    that began at version 5 fires from it; the armed timer belongs to the current stay."""
    rows = [
        _row(2, "remind", ("pending", "pending"), fired=(1, 0)),
        _row(3, "remind", ("pending", "pending"), fired=(1, 1)),
        _row(4, "escalate", ("pending", "review"), request_id="req-1"),
        _row(5, "reopen", ("review", "pending")),
        _row(6, "remind", ("pending", "pending"), fired=(5, 0)),
        _row(7, "expire", ("pending", "rejected"), fired=(5, 0)),
        _row(8, "reopen", ("rejected", "pending")),
    ]
    inst = _instance(rows, stay=8)
    verdict = check(inst, rows, initial_state="pending", timers=[_timer(8)])
    assert verdict.ok, verdict.describe()
    assert check(_instance(rows, stay=None), rows, timers=[_timer(8)]).ok


def test_a_firing_after_its_stay_ended_is_a_violation() -> None:
    """The timer of the first stay fires after the instance moved on (and back): stale-timer,
    naming both stays."""
    rows = [
        _row(2, "escalate", ("pending", "review")),
        _row(3, "reopen", ("review", "pending")),
        _row(4, "expire", ("pending", "rejected"), fired=(1, 0)),
    ]
    verdict = check(_instance(rows, stay=4), rows, initial_state="pending")
    assert not verdict.ok
    assert verdict.kinds() == {STALE_TIMER}
    (violation,) = verdict.violations
    assert violation.version == 4
    assert "stay that began at version 1" in violation.message
    assert "stay that began at version 3" in violation.message
    assert "'timer:1:expire:0'" in violation.message


def test_a_firing_of_a_stay_not_begun_is_a_violation() -> None:
    """A firing names a stay later than the instance's (a version that had not changed state)."""
    rows = [
        _row(2, "note", ("pending", "pending")),
        _row(3, "expire", ("pending", "rejected"), fired=(2, 0)),
    ]
    verdict = check(_instance(rows, stay=3), rows, initial_state="pending")
    assert verdict.kinds() == {STALE_TIMER}
    assert "no such stay had begun" in verdict.violations[0].message


def test_a_firing_from_another_state_than_its_stays_is_a_violation() -> None:
    """In its stay by number, but the row starts from a state the stay never had: stale-timer
    (and the chain is broken)."""
    rows = [
        _row(2, "escalate", ("pending", "review")),
        _row(3, "expire", ("pending", "rejected"), fired=(2, 0)),
    ]
    verdict = check(_instance(rows, stay=3), rows, initial_state="pending")
    assert verdict.kinds() == {STALE_TIMER, BROKEN_CHAIN}
    stale = [v for v in verdict.violations if v.kind == STALE_TIMER]
    assert "starts from 'pending', not 'review'" in stale[0].message


def test_a_firing_under_another_events_request_id_is_a_violation() -> None:
    """The row's event is not the one its timer's request id names."""
    row = _row(2, "approve", ("pending", "approved"), fired=(1, 0))
    rows = [dataclasses.replace(row, request_id="timer:1:expire:0")]
    verdict = check(_instance(rows, stay=2), rows, initial_state="pending")
    assert verdict.kinds() == {STALE_TIMER}
    assert "names the event 'expire'" in verdict.violations[0].message


def test_a_timer_firing_applied_twice_is_one_double_apply() -> None:
    """Two rows of one (stay, event, n): reported once, as the timer's double apply, not again as a
    repeated request id."""
    rows = [
        _row(2, "remind", ("pending", "pending"), fired=(1, 0)),
        _row(3, "remind", ("pending", "pending"), fired=(1, 1)),
        _row(4, "remind", ("pending", "pending"), fired=(1, 0)),
    ]
    verdict = check(_instance(rows, stay=1), rows, initial_state="pending")
    assert verdict.kinds() == {DOUBLE_APPLY}
    (violation,) = verdict.violations
    assert violation.version == 4
    assert "firing 0) applied twice: at version 2 and again at version 4" in violation.message


def test_a_callers_row_under_a_timers_request_id_is_still_a_double_apply() -> None:
    """A caller's row and the timer's row under one request id: the repeated request id is
    reported as before."""
    rows = [
        _row(2, "remind", ("pending", "pending"), request_id="timer:1:remind:0"),
        _row(3, "remind", ("pending", "pending"), fired=(1, 0)),
    ]
    verdict = check(_instance(rows, stay=1), rows, initial_state="pending")
    assert verdict.kinds() == {DOUBLE_APPLY}
    assert "request 'timer:1:remind:0' applied again" in verdict.violations[0].message


def test_an_armed_timer_of_an_ended_stay_is_a_violation() -> None:
    """The instance left the stay that armed a timer that is still armed: stray-timer; one of
    another instance too."""
    rows = [_row(2, "escalate", ("pending", "review"))]
    inst = _instance(rows, stay=2)
    verdict = check(inst, rows, timers=[_timer(1), _timer(2, "nudge")])
    assert verdict.kinds() == {STRAY_TIMER}
    (violation,) = verdict.violations
    assert "armed for the stay that began at version 1" in violation.message
    assert "in the stay that began at version 2 ('review', version 2)" in violation.message
    other = Timer("b", "approval", "expire", 2, datetime.now(UTC))
    assert check(inst, rows, timers=[other]).kinds() == {STRAY_TIMER}
    assert check(inst, rows).ok  # timers not read: not checked


def test_check_many_takes_each_instances_timers() -> None:
    """check_many checks the timers given for an instance, and none for one left out."""
    rows = [_row(2, "escalate", ("pending", "review"))]
    inst = _instance(rows, stay=2)
    assert check_many([(inst, rows)], timers={ID: [_timer(1)]}).kinds() == {STRAY_TIMER}
    assert check_many([(inst, rows)], timers={"b": [_timer(1)]}).ok


def _timed() -> flowlock.Workflow:
    return flowlock.Workflow(
        "approval",
        states=["pending", "approved", "rejected"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition(
                "expire", source="pending", target="rejected", after=timedelta(milliseconds=200)
            ),
            flowlock.Transition(
                "remind",
                source="pending",
                target="pending",
                every=timedelta(milliseconds=50),
                limit=2,
            ),
            flowlock.Transition("reopen", source="rejected", target="pending"),
        ],
    )


async def _until(engine: flowlock.Engine, instance_id: str, state: str) -> None:
    """Return once the instance reaches `state` (a generous bound: 20 s)."""

    async def there() -> bool:
        return (await engine.get(instance_id)).state == state

    await wait_until(there, within=20, what=f"{instance_id} in {state}")


async def test_a_run_with_timers_is_clean() -> None:
    """Reminders and an expiry fired by the engine, then a new stay, pass `flowlock check`'s
    reader (its histories and armed timers)."""
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(_timed())
        await engine.create("approval", instance_id="ok")
        await _until(engine, "ok", "rejected")
        history = await engine.history("ok")
        assert {e.actor for e in history} == {TIMER_ACTOR}
        assert history[-1].request_id == "timer:1:expire:0"
        await engine.fire("ok", "reopen")
        assert {t.stay for t in await engine.timers("ok")} == {history[-1].version + 1}
        report = await check_instances(engine, None)
        assert report.verdict.ok, report.verdict.describe()
        assert report.instances == 1 and report.rows >= len(history) + 1


async def test_a_broken_store_is_caught_by_flowlock_checks_reader() -> None:
    """A commit that leaves the stay without voiding its timers (a store or strategy bug), then
    the first stay's expiry written anyway: stale-timer and stray-timer, naming the instance."""
    store = MemoryStore()
    # No timer service: the stray timers stay armed for the check to find.
    async with flowlock.Engine(store, timers=False) as engine:
        await engine.register(_timed())
        await engine.create("approval", instance_id="bad")
        leave = _row(2, "approve", ("pending", "approved"))
        stale = _row(3, "expire", ("approved", "rejected"), fired=(1, 0))
        for entry in (leave, stale):
            assert await store.commit([dataclasses.replace(entry, instance_id="bad")])
        assert {t.stay for t in await engine.timers("bad")} == {1}
        report = await check_instances(engine, "bad")
        assert report.verdict.kinds() == {STALE_TIMER, STRAY_TIMER}, report.verdict.describe()
        assert all("'bad'" in v.message for v in report.verdict.violations)
