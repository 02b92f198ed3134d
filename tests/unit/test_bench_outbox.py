"""The bench's outbox section without PostgreSQL: the emitting scenarios and their place in a run,
the judge and the delivery figures on hand-built rounds, the sink, each pair beside its twin,
and the section in the JSON and the tables."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from rich.console import Console
from test_bench_report import _report, _result

from flowlock.bench import SCENARIO_ALIASES, SCENARIOS, BenchConfig
from flowlock.bench.idle import KINDS, statement_kind
from flowlock.bench.outbox_results import (
    DeliveryFigures,
    OutboxIdle,
    OutboxSection,
    Quantiles,
    outbox_pairs,
)
from flowlock.bench.report import render, to_json
from flowlock.bench.report.cells import ELLIPSIS
from flowlock.bench.results import CallResult, CallSpec, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios import HotOutbox, SpreadOutbox
from flowlock.bench.scenarios.outbox import (
    KIND,
    MESSAGE_LEFT,
    MESSAGE_LOST,
    STRAY_MESSAGE,
    WORKFLOW,
    Delivery,
    Sink,
    delivery_figures,
    delivery_violations,
    emitting_counter,
    expected_keys,
)
from flowlock.checker import Verdict, Violation
from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import Message
from flowlock.engine import Engine
from flowlock.stores.memory import MemoryStore

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
PARAMS = Params(workers=2, ops=2)


# -- the scenarios ---------------------------------------------------------------------------------


def test_the_emitting_scenarios_are_hot_and_spread_with_a_twin_and_no_floor() -> None:
    """hot-outbox and spread-outbox are registered after their twins, emit, name the twin they
    are compared with, have no raw floor (no dispatcher there), and keep the twins' sizes."""
    names = list(SCENARIOS)
    assert names.index("hot-outbox") == names.index("hot") + 1
    assert names.index("spread-outbox") == names.index("spread") + 1
    for name, twin in (("hot-outbox", "hot"), ("spread-outbox", "spread")):
        scenario, plain = SCENARIOS[name], SCENARIOS[twin]
        assert scenario.emits and not plain.emits
        assert scenario.baseline == twin and plain.baseline is None
        assert not scenario.has_floor and not scenario.multiprocess
        config = BenchConfig(scenarios=(name, twin))
        assert config.ops_for(scenario) == config.ops_for(plain)
        assert scenario.instances(PARAMS) == plain.instances(PARAMS)  # type: ignore[attr-defined]
        # Rounds with messages, each after one without: hot's are short, so three of each
        # (spread two); one each under --quick.
        assert config.rounds_for(scenario) == (3 if twin == "hot" else 2)
        assert BenchConfig(quick=True).rounds_for(scenario) == 1
        names = [w.name for w in scenario.workflows(PARAMS)]
        assert names == ["counter", WORKFLOW]
        assert scenario.counter_for(PARAMS) == WORKFLOW  # type: ignore[attr-defined]
        assert scenario.counter_for(PARAMS.evolve(quiet=True)) == "counter"  # type: ignore[attr-defined]
    assert isinstance(SCENARIOS["hot-outbox"], HotOutbox)
    assert isinstance(SCENARIOS["spread-outbox"], SpreadOutbox)


def test_outbox_names_the_section() -> None:
    """`-s outbox` runs hot-outbox and spread-outbox; named twice, each runs once."""
    assert SCENARIO_ALIASES["outbox"] == ("hot-outbox", "spread-outbox")
    config = BenchConfig(scenarios=("outbox", "hot-outbox", "storm"))
    config.validate()
    assert config.scenario_names() == ("hot-outbox", "spread-outbox", "storm")
    with pytest.raises(InvalidInput, match=r"choose from .*outbox"):
        BenchConfig(scenarios=("outbx",)).validate()


def test_the_outbox_pairs_run_in_the_bench_process_only() -> None:
    """--http and --hosts refuse the emitting scenarios: their handler's sink is this
    process's memory."""
    with pytest.raises(InvalidInput, match="bench's own engine"):
        BenchConfig(http=True, scenarios=("hot-outbox",)).validate()
    with pytest.raises(InvalidInput, match="'hot-outbox' runs in the bench's own process"):
        BenchConfig(hosts=2, scenarios=("outbox",)).validate()


async def test_every_step_of_the_emitting_counter_writes_one_message() -> None:
    """Each applied step counts one up and emits one `bench.sink` message with the new count,
    keyed by its version (the memory store's outbox)."""
    async with Engine(MemoryStore()) as engine:
        await engine.register(emitting_counter())
        await engine.create(WORKFLOW, instance_id="c", data={"n": 0})
        for _ in range(3):
            await engine.fire("c", "step")
        messages = await engine.messages("c")
        history = await engine.history("c")
    assert [m.key for m in messages] == ["c:2:0", "c:3:0", "c:4:0"]
    assert {m.kind for m in messages} == {KIND}
    assert [m.payload for m in messages] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert expected_keys({"c": history}) == {m.key for m in messages}


async def test_the_sink_notes_each_delivery() -> None:
    """The handler notes the key, its start, the store's commit time and claim lag, and the
    attempt; `of` keeps the deliveries of a round's instances."""
    sink = Sink()
    message = Message(
        key="r1-0:2:0",
        instance_id="r1-0",
        workflow=WORKFLOW,
        version=2,
        n=0,
        kind=KIND,
        payload={"n": 1},
        status="running",
        attempts=1,
        created_at=T0,
        lag=0.004,
    )
    await sink.handler(message)
    await sink.handler(replace(message, key="other:2:0", instance_id="other", created_at=None))
    first, second = sink.deliveries
    assert (first.key, first.committed, first.claim_lag, first.attempt) == (
        "r1-0:2:0",
        T0.timestamp(),
        0.004,
        1,
    )
    assert first.started > 0 and second.committed is None
    assert sink.of({"r1-0": "open"}) == [first]


# -- the judge -------------------------------------------------------------------------------------


def _entry(iid: str, version: int) -> HistoryEntry:
    return HistoryEntry(
        instance_id=iid,
        version=version,
        event="step",
        from_state="open",
        to_state="open",
        actor=f"w0-{version}",
        request_id=None,
        strategy="optimistic",
        data={"n": version - 1},
        at=T0,
    )


def _record(
    deliveries: Sequence[Delivery],
    *,
    steps: int = 2,
    left: dict[str, int] | None = None,
    offset: float = 0.0,
) -> RoundRecord:
    """One instance `i` stepped `steps` times by its callers (told applied), and what the
    handler saw."""
    rows = [_entry("i", v) for v in range(2, steps + 2)]
    calls = tuple(CallSpec("i", "step", actor=e.actor) for e in rows)
    plan = RoundPlan({"i": "open"}, lanes=(calls,), extra={"offset": offset})
    results = tuple(CallResult(c, "applied", 0.01, 1) for c in calls)
    final = Instance(id="i", workflow=WORKFLOW, state="open", version=steps + 1, data={"n": steps})
    extra: dict[str, Any] = {
        "deliveries": list(deliveries),
        "left": left or {"pending": 0, "running": 0, "dead": 0},
    }
    return RoundRecord(plan, results, {"i": final}, {"i": rows}, extra)


def _delivered(key: str, after_ms: float, claim_ms: float = 1.0) -> Delivery:
    committed = T0.timestamp()
    return Delivery(key, committed + after_ms / 1000, committed, claim_ms / 1000)


def test_a_round_whose_every_message_was_delivered_is_clean() -> None:
    """Both steps' messages reached the handler and nothing is left: no violation."""
    record = _record([_delivered("i:2:0", 3), _delivered("i:3:0", 5)])
    judged = SCENARIOS["hot-outbox"].judge(record, PARAMS)
    assert judged.violations == () and not judged.double_advanced


@pytest.mark.parametrize(
    ("deliveries", "left", "kind"),
    [
        ([("i:2:0", 3)], None, MESSAGE_LOST),
        ([("i:2:0", 3), ("i:3:0", 4), ("i:9:0", 4)], None, STRAY_MESSAGE),
        ([("i:2:0", 3), ("i:3:0", 4)], {"pending": 0, "running": 0, "dead": 1}, MESSAGE_LEFT),
    ],
)
def test_the_judge_catches_a_lost_a_stray_and_a_left_message(
    deliveries: list[tuple[str, float]], left: dict[str, int] | None, kind: str
) -> None:
    """A transition whose message never came, a message of no transition, a message left
    dead or pending: each is a violation of its own kind."""
    record = _record([_delivered(k, ms) for k, ms in deliveries], left=left)
    found = delivery_violations(record)
    assert [v.kind for v in found] == [kind]
    assert [v.kind for v in SCENARIOS["spread-outbox"].judge(record, PARAMS).violations] == [kind]


def test_a_round_without_messages_must_deliver_none() -> None:
    """A quiet round's transitions emit nothing: a delivery for one of its instances is a
    stray message, and its figures are not the pair's delivery figures."""
    quiet = replace(_record([]), plan=replace(_record([]).plan, extra={"quiet": True}))
    assert delivery_violations(quiet) == ()
    assert delivery_figures([quiet]).emitted == 0
    leaked = replace(quiet, extra={**quiet.extra, "deliveries": [_delivered("i:2:0", 1)]})
    assert [v.kind for v in delivery_violations(leaked)] == [STRAY_MESSAGE]


def test_a_redelivery_is_counted_not_judged() -> None:
    """At-least-once allows a second delivery: counted as a duplicate, no violation, and the
    lag is the first delivery's."""
    record = _record([_delivered("i:2:0", 3), _delivered("i:3:0", 5), _delivered("i:2:0", 90)])
    assert delivery_violations(record) == ()
    figures = delivery_figures([record])
    assert (figures.emitted, figures.delivered, figures.duplicates) == (2, 2, 1)
    assert figures.lag.max_ms == pytest.approx(5.0, abs=1e-3)
    assert figures.ok


def test_the_lag_runs_from_the_commit_to_the_handler_on_the_server_clock() -> None:
    """The handler's start is moved onto the server's clock by the round's offset; the claim
    lag is the store's own."""
    deliveries = [_delivered(f"i:{v}:0", 10.0 * v, claim_ms=v) for v in range(2, 12)]
    record = _record(deliveries, steps=10, offset=0.002)
    figures = delivery_figures([record, _record([], steps=0)])
    assert figures.emitted == figures.delivered == 10
    assert figures.lag.count == 10
    assert figures.lag.p50_ms == pytest.approx(62.0, abs=1e-3)  # 60 ms, plus the 2 ms offset
    assert figures.lag.max_ms == pytest.approx(112.0, abs=1e-3)
    assert figures.claim_lag.p99_ms == pytest.approx(11.0)
    lost = delivery_figures([_record(deliveries[:9], steps=10)])
    assert (lost.delivered, lost.lost, lost.ok) == (9, 1, False)


def test_the_scenario_names_its_twin_on_its_figures() -> None:
    """`delivery` is the figures of the pair's rounds, with the twin's name."""
    record = _record([_delivered("i:2:0", 3), _delivered("i:3:0", 5)])
    figures = SCENARIOS["spread-outbox"].delivery([record])
    assert figures is not None and figures.baseline == "spread"
    assert SCENARIOS["spread"].delivery([record]) is None


# -- the report ------------------------------------------------------------------------------------


def _delivery(baseline: str, **changes: Any) -> DeliveryFigures:
    figures = DeliveryFigures(
        emitted=2000,
        delivered=2000,
        duplicates=0,
        lost=0,
        stray=0,
        left=0,
        lag=Quantiles(2000, 3.21, 17.45, 30.0),
        claim_lag=Quantiles(2000, 1.5, 9.87, 12.0),
        baseline=baseline,
    )
    return replace(figures, **changes)


def _idle(**changes: Any) -> OutboxIdle:
    idle = OutboxIdle(
        engines=1,
        done=10_000,
        window_s=10.0,
        statements_per_s={"outbox": 0.0, "listen": 0.0, "timers": 0.0, "escalations": 2.3},
        scans_per_s={"flowlock_outbox": 0.0, "flowlock_escalations": 2.3},
        database="dedicated",
        method="m",
    )
    return replace(idle, **changes)


def _emitting(
    strategy: str, scenario: str, per_s: float, without: float | None, **changes: Any
) -> Any:
    """An outbox pair's result: `per_s` applied/s with messages, `without` in its quiet rounds
    (None: it ran none)."""
    quiet = None
    if without is not None:
        quiet = _result(strategy, scenario=scenario, applied_per_s=without, p99_ms=20.0)
    baseline = scenario.removesuffix("-outbox")
    return _result(
        strategy,
        scenario=scenario,
        applied_per_s=per_s,
        delivery=changes.pop("delivery", _delivery(baseline)),
        without=quiet,
        **changes,
    )


def _outbox_report(**idle: Any) -> Any:
    results = (
        _result("optimistic", scenario="hot", applied_per_s=9000.0),
        _emitting("optimistic", "hot-outbox", 4600.0, 5000.0),
        _emitting("pessimistic", "hot-outbox", 4800.0, 6000.0),
        _emitting(
            "optimistic",
            "spread-outbox",
            3000.0,
            None,
            delivery=_delivery("spread", lost=3, delivered=1997),
            verdict=Verdict.of([Violation(MESSAGE_LOST, "3 message(s)")]),
        ),
    )
    return replace(_report(*results), outbox=OutboxSection(_idle(**idle), ("a note",)))


def test_each_outbox_pair_is_its_rounds_with_messages_against_those_without() -> None:
    """The ratio is applied/s with messages over without, in the pair's own rounds (never the
    hot pair of the run); with no round without, there is no ratio and no judgement."""
    pairs = outbox_pairs(_outbox_report())
    assert [(p.scenario, p.baseline, p.strategy) for p in pairs] == [
        ("hot-outbox", "hot", "optimistic"),
        ("hot-outbox", "hot", "pessimistic"),
        ("spread-outbox", "spread", "optimistic"),
    ]
    optimistic, pessimistic, spread = pairs
    assert optimistic.ratio == pytest.approx(0.92) and optimistic.met is True
    assert (optimistic.with_p99_ms, optimistic.without_p99_ms) == (30.0, 20.0)
    assert pessimistic.ratio == pytest.approx(0.8) and pessimistic.met is False
    assert spread.ratio is None and spread.met is None
    assert spread.violations == 1 and not spread.verdict_ok


def test_the_json_has_the_outbox_section() -> None:
    """`outbox` holds each pair (applied/s both ways, the ratio and its target, the delivery,
    the lag), the idle cost by kind, the notes and the targets; every figure is JSON as is."""
    doc = to_json(_outbox_report())
    outbox = doc["outbox"]
    json.dumps(outbox)
    first = outbox["pairs"][0]
    assert first["scenario"] == "hot-outbox" and first["baseline"] == "hot"
    assert first["applied_per_s"] == 4600.0 and first["without_applied_per_s"] == 5000.0
    assert first["p99_ms"] == 30.0 and first["without_p99_ms"] == 20.0
    assert first["ratio"] == 0.92 and first["target_ratio"] == 0.9 and first["met"] is True
    assert first["emitted"] == first["delivered"] == 2000 and first["all_delivered"] is True
    assert first["lag"] == {"count": 2000, "p50_ms": 3.21, "p99_ms": 17.45, "max_ms": 30.0}
    assert first["claim_lag"]["p99_ms"] == 9.87
    assert first["verdict"] == {"ok": True, "violations": 0}
    last = outbox["pairs"][-1]
    assert last["without_applied_per_s"] is None and last["ratio"] is None
    assert last["met"] is None and last["all_delivered"] is False and last["lost"] == 3
    idle = outbox["idle"]
    assert idle["outbox_statements_per_s"] == 0.0 and idle["met"] is True
    assert idle["statements_by_kind"]["escalations"] == 2.3 and idle["done"] == 10_000
    assert outbox["notes"] == ["a note"]
    assert outbox["targets"] == {
        "applied_per_s_ratio": 0.9,
        "idle_outbox_statements_per_s": 0.0,
    }
    assert doc["ok"] is False  # the spread pair lost messages
    assert to_json(_report(_result("optimistic")))["outbox"] is None


def test_a_dispatcher_that_polls_misses_the_idle_target() -> None:
    """Any statement naming the outbox's table while nothing is pending misses the target;
    the LISTEN connection's and the escalation board's do not count against it."""
    assert _idle().met
    assert not _idle(statements_per_s={"outbox": 0.1, "listen": 0.0}).met
    assert statement_kind("flowlock-ab", "SELECT key FROM flowlock_outbox WHERE") == "outbox"
    assert statement_kind("flowlock-ab-outbox", 'LISTEN "flowlock_outbox"') == "listen"
    assert "outbox" in KINDS


@pytest.mark.parametrize("width", [80, 120, 160])
def test_the_outbox_tables_fit_the_terminal(width: int) -> None:
    """The pairs and the idle cost print whole at 80, 120 and 160 columns."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    render(_outbox_report(), console)
    text = console.export_text()
    assert ELLIPSIS not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for shown in ("5,000", "4,600", "0.92×", "0.80×", "17.4", "9.9", "2,000", "10,000", "2.30"):
        assert shown in text, shown
    for words in ("one message per transition", "outbox: idle cost", "not met"):
        assert words in text, words
    assert "note: a note" in text


def test_an_idle_cost_without_scans_shows_a_dash() -> None:
    """Under --quick the scans are not counted: null in the JSON, a dash in the table."""
    report = _outbox_report(scans_per_s=None)
    assert to_json(report)["outbox"]["idle"]["scans_per_s"] is None
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    render(report, console)
    row = next(line for line in console.export_text().splitlines() if "1 engine " in line)
    assert row.split()[-2] == "—"
