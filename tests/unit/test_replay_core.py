"""The pure replay (flowlock.core.replay) on hand-written histories: timer firings, instances
created before their data was stored, steps that raise, operator rows and the report."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from flowlock import Transition, Workflow
from flowlock.core.models import TIMER_ACTOR, HistoryEntry, Instance, timer_request_id
from flowlock.core.replay import KINDS, Divergence, ReplayReport, replay


def _row(
    version: int,
    event: str,
    src: str,
    dst: str,
    data: Mapping[str, Any],
    *,
    request_id: str | None = None,
    actor: str | None = None,
) -> HistoryEntry:
    return HistoryEntry("i1", version, event, src, dst, actor, request_id, "optimistic", data)


def _timed(after: float = 60) -> Workflow:
    wait = timedelta(seconds=after)
    return Workflow(
        "t",
        states=["waiting", "expired", "done"],
        initial="waiting",
        transitions=[
            Transition("expire", source="waiting", target="expired", after=wait),
            Transition("finish", source="waiting", target="done"),
        ],
    )


def _inst(state: str, version: int, data: Mapping[str, Any] | None = None) -> Instance:
    return Instance("i1", "t", state, version, data or {})


def test_a_timer_firing_replays_like_any_event() -> None:
    """A row a timer wrote (its request id names the stay) replays clean; dropping its event is
    found like any other."""
    rid = timer_request_id(1, "expire", 0)
    rows = [_row(2, "expire", "waiting", "expired", {}, request_id=rid, actor=TIMER_ACTOR)]
    done = replay(_timed(), _inst("expired", 2), {}, rows)
    assert done.divergences == () and done.transitions == 1
    without = Workflow(
        "t",
        states=["waiting", "expired", "done"],
        initial="waiting",
        transitions=[
            Transition("finish", source="waiting", target="done"),
            Transition("lapse", source="waiting", target="expired"),
        ],
    )
    [found] = replay(without, _inst("expired", 2), {}, rows).divergences
    assert (found.kind, found.event, found.version) == ("event", "expire", 2)


def test_an_instance_without_initial_data_skips_its_first_row() -> None:
    """Created before initial data was stored: the first row is taken as recorded and counted,
    the later ones are replayed from it."""
    wf = Workflow(
        "t",
        states=["a", "b", "c"],
        initial="a",
        transitions=[
            Transition("go", source="a", target="b", effect=lambda i, p, a: {"x": 1}),
            Transition("on", source="b", target="c", effect=lambda i, p, a: {**i.data, "y": 2}),
        ],
    )
    rows = [_row(2, "go", "a", "b", {"x": 9}), _row(3, "on", "b", "c", {"x": 9, "y": 2})]
    done = replay(wf, _inst("c", 3), None, rows)
    # The first row's data (x 9) differs from what the effect gives (x 1), but it is not replayed.
    assert done.divergences == ()
    assert (done.unreplayed_first, done.transitions) == (True, 1)
    with_initial = replay(wf, _inst("c", 3), {}, rows)
    assert [d.kind for d in with_initial.divergences] == ["data"]


def test_an_effect_that_raises_is_a_refusal_with_its_error() -> None:
    """An effect raising during replay is a "refused" divergence carrying the error's text."""

    def boom(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        raise ZeroDivisionError("no rate")

    wf = Workflow(
        "t",
        states=["a", "b"],
        initial="a",
        transitions=[Transition("go", source="a", target="b", effect=boom)],
    )
    [found] = replay(wf, _inst("b", 2), {}, [_row(2, "go", "a", "b", {})]).divergences
    assert found.kind == "refused" and "ZeroDivisionError" in found.detail
    assert "no rate" in found.detail


def test_a_transition_from_another_source_is_refused() -> None:
    """A transition whose sources no longer hold the recorded state is "refused"."""
    wf = Workflow(
        "t",
        states=["a", "b", "c"],
        initial="a",
        transitions=[
            Transition("go", source="c", target="b"),
            Transition("to_c", source="a", target="c"),
        ],
    )
    [found] = replay(wf, _inst("b", 2), {}, [_row(2, "go", "a", "b", {})]).divergences
    assert (found.kind, found.expected, found.found) == ("refused", "b", None)


def test_operator_rows_and_the_migrate_row_are_not_replayed() -> None:
    """Every reserved event (force, pause, resume, and migrate from helper D) is taken as
    recorded."""
    rows = [
        _row(2, "flowlock:force", "waiting", "expired", {"k": 1}),
        _row(3, "flowlock:migrate", "expired", "waiting", {"k": 1}),
        _row(4, "finish", "waiting", "done", {"k": 1}),
    ]
    done = replay(_timed(), _inst("done", 4), None, rows)
    assert done.divergences == ()
    assert (done.operator_rows, done.transitions, done.unreplayed_first) == (2, 1, False)


def test_the_report_counts_and_serialises() -> None:
    """A report is ok only without divergences; its JSON holds the counts of every kind."""
    d = Divergence("i1", 2, "go", "target", "b", "c", "it now goes to 'c', not 'b'")
    report = ReplayReport("t", 1, 1, (d,), 0.5)
    assert not report.ok and ReplayReport("t", 1, 1, (), 0.1).ok
    assert report.counts() == {**dict.fromkeys(KINDS, 0), "target": 1}
    as_json = report.as_json()
    assert as_json["divergences"] == [d.as_json()]
    assert as_json["ok"] is False and as_json["counts"]["target"] == 1


def test_the_sync_engine_checks_a_definition() -> None:
    """flowlock.sync.Engine.check_definition is the blocking twin of the async one."""
    import flowlock.sync

    with flowlock.sync.Engine.connect("memory://") as engine:
        engine.register(_timed())
        engine.create("t", instance_id="i1")
        engine.fire("i1", "finish")
        assert engine.check_definition(_timed()).ok
        narrower = Workflow("t", states=["waiting"], initial="waiting", transitions=[])
        report = engine.check_definition(narrower, instance_ids=["i1"])
        assert {d.kind for d in report.divergences} == {"event", "state"}


def test_a_row_the_two_admins_rule_would_answer_is_refused() -> None:
    """A recorded move from a state the new definition's event no longer leaves, which the
    engine would answer as already done (same event last, state among its targets), is a
    refusal: the new definition would not apply it."""
    wf = Workflow(
        "t",
        states=["a", "b", "c"],
        initial="a",
        transitions=[
            Transition("go", source="a", target="b"),
            Transition("on", source="b", target="c"),
        ],
    )
    rows = [_row(2, "go", "a", "b", {}), _row(3, "go", "b", "c", {})]
    [found] = replay(wf, _inst("c", 3), {}, rows).divergences
    assert (found.version, found.kind) == (3, "refused")
    assert "already applied" in found.detail


def test_replay_row_keeps_the_history_up_to_the_version_read() -> None:
    """Rows of a later move are left out; a history with a gap (purged meanwhile) is no row."""
    from flowlock.stores.replaying import replay_row

    rows = [_row(2, "go", "a", "b", {}), _row(3, "on", "b", "c", {}), _row(4, "x", "c", "d", {})]
    made = replay_row(_inst("c", 3), {}, list(reversed(rows)))
    assert made is not None and [h.version for h in made[2]] == [2, 3]
    assert replay_row(_inst("c", 3), {}, [rows[1]]) is None
    assert replay_row(_inst("a", 1), None, []) == (_inst("a", 1), None, [])


def test_a_payload_the_new_schema_refuses_is_a_refused_divergence() -> None:
    """A recorded payload that the new definition's payload schema refuses is reported as
    "refused", naming the schema, not as an effect's bad data."""
    rows = [_row(2, "finish", "waiting", "done", {})]
    typed = Workflow(
        "t",
        states=["waiting", "expired", "done"],
        initial="waiting",
        transitions=[
            Transition(
                "finish",
                source="waiting",
                target="done",
                payload={"type": "object", "required": ["reason"]},
            ),
            Transition("lapse", source="waiting", target="expired"),
        ],
    )
    found = replay(typed, _inst("done", 2), {}, rows).divergences
    assert [(d.kind, d.version) for d in found] == [("refused", 2)]
    assert "payload schema" in found[0].detail
