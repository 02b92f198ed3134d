"""hot and spread again, each transition emitting one outbox message into a local sink.

`hot-outbox` and `spread-outbox` are `hot` and `spread` on a counter whose `step` emits one
message (`Emit("bench.sink", {"n": ...})`). The session's engine registers a handler for it that
only notes the delivery in memory (a `Sink`), so what the pair measures beyond the same calls
without messages is the outbox itself: the message written in the transition's transaction,
and the dispatcher claiming, handing over and marking it done, in the same process and on the
same pool as the callers.

Each timed round with messages follows a round without (`Params.quiet`): the same calls, on the
plain counter, on the same session, its dispatcher idle. The two kinds of round alternate, so
the load the rest of the machine puts on them is as alike as it can be, and their applied/s
compare like with like. A round ends when every message is delivered and none is pending; the
judge adds to the steps' rules that every committed message reached the handler, and no other
(none at all in a round without).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from weakref import WeakKeyDictionary

from flowlock.bench.outbox_results import DeliveryFigures, Quantiles
from flowlock.bench.results import Judgement, Params, RoundPlan, RoundRecord
from flowlock.bench.scenarios.base import Session
from flowlock.bench.scenarios.deadline import clock_offset
from flowlock.bench.scenarios.steps import Hot, Spread, _Steps, counter
from flowlock.checker import Violation
from flowlock.core.definition import Transition, Workflow
from flowlock.core.errors import FlowlockError
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import Emit, Message, message_key, parse_key
from flowlock.engine import Engine
from flowlock.stores.base import OutboxStore

__all__ = [
    "KIND",
    "MESSAGE_LEFT",
    "MESSAGE_LOST",
    "SETTLE_BOUND",
    "STRAY_MESSAGE",
    "WORKFLOW",
    "Delivery",
    "HotOutbox",
    "Sink",
    "SpreadOutbox",
    "delivery_figures",
    "delivery_violations",
    "emitting_counter",
    "expected_keys",
    "settle",
    "sink_of",
]

KIND = "bench.sink"
"""The kind of message every `step` emits, and the one the sink's handler is registered for."""
WORKFLOW = "counter-outbox"
"""The emitting counter's name: `counter`'s own would clash with its definition in the run's
schema, where `hot` and `spread` register the counter that emits nothing."""
SETTLE_BOUND = 60.0
"""The longest a round's readback waits for its last message to be delivered and done."""
_POLL = 0.02  # seconds between two looks at the store while the dispatcher drains

MESSAGE_LOST = "message-lost"
"""A violation: a transition in the history whose message never reached the handler."""
STRAY_MESSAGE = "stray-message"
"""A violation: the handler got a message of no transition in the history."""
MESSAGE_LEFT = "message-left"
"""A violation: messages still pending, running or dead once the round settled."""


def emitting_counter(name: str = WORKFLOW) -> Workflow:
    """`steps.counter`, whose `step` also emits one `KIND` message carrying the new count."""

    def add(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + 1}

    def emit(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> list[Emit]:
        return [Emit(KIND, {"n": inst.data.get("n")})]

    return Workflow(
        name,
        states=["open"],
        initial="open",
        transitions=[Transition("step", source="open", target="open", effect=add, emit=emit)],
    )


# -- the sink ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery the handler saw: the message's key and attempt, when the handler started
    (this machine's clock, epoch seconds), the store's commit time of the message (epoch
    seconds on the server's clock; None if the store gave none) and its claim lag."""

    key: str
    started: float
    committed: float | None
    claim_lag: float
    attempt: int = 1


@dataclass(slots=True)
class Sink:
    """What the handler of one engine received, in memory: the local sink of the issue."""

    deliveries: list[Delivery] = field(default_factory=list)

    async def handler(self, message: Message) -> None:
        """Note the delivery and return: the cheapest handler there is."""
        created = message.created_at
        self.deliveries.append(
            Delivery(
                message.key,
                time.time(),
                None if created is None else created.timestamp(),
                message.lag,
                message.attempt,
            )
        )

    def of(self, instances: Mapping[str, object]) -> list[Delivery]:
        """The deliveries of messages of these instances."""
        return [d for d in self.deliveries if parse_key(d.key)[0] in instances]


_SINKS: WeakKeyDictionary[Engine, Sink] = WeakKeyDictionary()


def sink_of(engine: Engine) -> Sink:
    """The sink of `engine`'s handler: made, and the handler registered, on first use."""
    sink = _SINKS.get(engine)
    if sink is None:
        sink = _SINKS[engine] = Sink()
        engine.on_emit(KIND, sink.handler)
    return sink


# -- the readback --------------------------------------------------------------------------------


def expected_keys(histories: Mapping[str, Sequence[HistoryEntry]]) -> set[str]:
    """The key of the message each history entry emitted: one per transition, n = 0."""
    return {message_key(iid, e.version, 0) for iid, rows in histories.items() for e in rows}


def _outbox(engine: Engine) -> OutboxStore:
    store = engine.store
    if not isinstance(store, OutboxStore):
        raise FlowlockError(f"the {type(store).__name__} has no outbox: the outbox pairs need one")
    return store


async def _left(engine: Engine) -> dict[str, int]:
    """Messages not done, per status (pending, running, dead), in the whole store."""
    counts = await _outbox(engine).count_messages()
    return {s: int(counts.get(s, 0)) for s in ("pending", "running", "dead")}


async def settle(engine: Engine, want: set[str], bound: float = SETTLE_BOUND) -> dict[str, int]:
    """Wait, at most `bound` seconds, until the sink has every key of `want` and the store has
    no message of `KIND` pending or running; what is left then, per status."""
    sink = sink_of(engine)
    store = _outbox(engine)
    until = time.monotonic() + bound
    while time.monotonic() < until:
        # The sink first: it is this process's memory. The store only once the sink is done,
        # through its due index (a count would read every done message, while the dispatcher
        # drains on the same cores).
        delivered = want <= {d.key for d in sink.deliveries}
        if delivered and await store.next_message_due([KIND]) is None:
            break
        await asyncio.sleep(_POLL)
    return await _left(engine)


class _Emitting(_Steps):
    """The steps on the emitting counter; the engine's handler notes every delivery."""

    emits = True
    has_floor = False
    counter_workflow = WORKFLOW
    default_rounds = 3

    def workflows(self, params: Params) -> Sequence[Workflow]:
        return [counter(), emitting_counter(self.counter_workflow)]

    def counter_for(self, params: Params) -> str:
        return counter().name if params.quiet else self.counter_workflow

    def attach(self, engine: Engine) -> None:
        sink_of(engine)

    async def setup(
        self, engine: Engine, key: str, params: Params, rng: random.Random
    ) -> RoundPlan:
        # The warm-up's messages (or another round's) are delivered before this round starts,
        # so that its dispatcher begins with nothing behind it.
        await settle(engine, set())
        plan = await super().setup(engine, key, params, rng)
        extra = {**plan.extra, "offset": await clock_offset(engine), "quiet": params.quiet}
        return RoundPlan(plan.instances, plan.calls, plan.lanes, extra)

    async def readback(
        self, session: Session, plan: RoundPlan
    ) -> tuple[dict[str, Instance], dict[str, list[HistoryEntry]], dict[str, Any]]:
        finals, histories, extra = await super().readback(session, plan)
        if plan.extra.get("quiet"):
            left = await _left(session.engine)  # nothing to wait for: nothing was emitted
        else:
            left = await settle(session.engine, expected_keys(histories))
        deliveries = sink_of(session.engine).of(plan.instances)
        return finals, histories, {**extra, "deliveries": deliveries, "left": left}

    def judge(self, record: RoundRecord, params: Params) -> Judgement:
        steps = super().judge(record, params)
        return Judgement(steps.double_advanced, steps.violations + delivery_violations(record))

    def delivery(self, records: Sequence[RoundRecord]) -> DeliveryFigures | None:
        return replace(delivery_figures(records), baseline=self.baseline or "")


def _wanted(record: RoundRecord) -> set[str]:
    """The keys of the messages the round's transitions emitted: none in a quiet round."""
    return set() if record.plan.extra.get("quiet") else expected_keys(record.histories)


def delivery_violations(record: RoundRecord) -> tuple[Violation, ...]:
    """Every message of a transition in the history delivered, no other one, none left."""
    want = _wanted(record)
    deliveries: Sequence[Delivery] = record.extra.get("deliveries", ())
    seen = {d.key for d in deliveries}
    found: list[Violation] = []
    lost = sorted(want - seen)
    if lost:
        found.append(
            Violation(
                MESSAGE_LOST,
                f"{len(lost)} message(s) of applied transitions never reached the handler "
                f"(first: {', '.join(lost[:5])})",
            )
        )
    stray = sorted(seen - want)
    if stray:
        found.append(
            Violation(
                STRAY_MESSAGE,
                f"{len(stray)} message(s) delivered for no transition in the history "
                f"(first: {', '.join(stray[:5])})",
            )
        )
    left: Mapping[str, int] = record.extra.get("left", {})
    if any(left.values()):
        counted = ", ".join(f"{n} {status}" for status, n in left.items() if n)
        found.append(
            Violation(MESSAGE_LEFT, f"messages not done once the round settled: {counted}")
        )
    return tuple(found)


def delivery_figures(records: Sequence[RoundRecord]) -> DeliveryFigures:
    """What the handler saw over the pair's timed rounds (see `DeliveryFigures`)."""
    emitted = delivered = duplicates = lost = stray = left = 0
    lags: list[float] = []
    claims: list[float] = []
    for record in records:
        if record.plan.extra.get("quiet"):
            continue  # judged, not measured: its figures are the pair's `without`
        want = expected_keys(record.histories)
        deliveries: Sequence[Delivery] = record.extra.get("deliveries", ())
        offset = float(record.plan.extra.get("offset", 0.0))
        seen: set[str] = set()
        for d in sorted(deliveries, key=lambda d: d.started):
            if d.key in seen:
                duplicates += 1
                continue
            seen.add(d.key)
            claims.append(d.claim_lag)
            if d.committed is not None:
                lags.append(max(0.0, d.started + offset - d.committed))
        emitted += len(want)
        delivered += len(seen & want)
        lost += len(want - seen)
        stray += len(seen - want)
        left += sum(record.extra.get("left", {}).values())
    return DeliveryFigures(
        emitted=emitted,
        delivered=delivered,
        duplicates=duplicates,
        lost=lost,
        stray=stray,
        left=left,
        lag=Quantiles.of(lags),
        claim_lag=Quantiles.of(claims),
    )


class HotOutbox(_Emitting, Hot):
    """`hot`, each step emitting one message that the engine's dispatcher delivers."""

    name = "hot-outbox"
    summary = "hot, each step emitting one outbox message delivered to a local sink"
    baseline = "hot"


class SpreadOutbox(_Emitting, Spread):
    """`spread`, each step emitting one message that the engine's dispatcher delivers."""

    name = "spread-outbox"
    summary = "spread, each step emitting one outbox message delivered to a local sink"
    baseline = "spread"
    # Its rounds are 6,000 calls, long enough for a steady figure: two of each kind.
    default_rounds = 2
