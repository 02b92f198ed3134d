"""Per-instance batching on the memory store: a batch answers every call exactly as the same calls
run one after the other would (a property test, on the pure step and through the engine), each
caller gets its own answer, and cancelling a caller (queued, in flight, or the one running alone)
never stops or hangs the others."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowlock
from flowlock import examples
from flowlock.checker import check
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.core.step import Call, Idempotent, decide, decide_batch
from flowlock.locks import MemoryLocks
from flowlock.stores import MemoryStore

BOUND = 10.0  # seconds any wait here may take before the test calls it a hang (generous)


def counter() -> flowlock.Workflow:
    """A workflow with every kind of answer: applied (with an effect), refused by a guard, not
    allowed, a step that raises, data over the payload limit, a cycle and the two-admins rule."""

    def positive(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        return int(payload.get("n", 0)) > 0

    def add(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {**inst.data, "n": int(inst.data.get("n", 0)) + int(payload.get("n", 0))}

    def boom(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        raise RuntimeError("boom")

    def huge(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> dict[str, Any]:
        return {"blob": "x" * 4096}

    return flowlock.Workflow(
        "counter",
        strategy="adaptive",  # every call here names its strategy; this only quiets the warning
        states=["open", "closed"],
        initial="open",
        transitions=[
            flowlock.Transition("add", source="open", target="open", guard=positive, effect=add),
            flowlock.Transition("close", source="open", target="closed"),
            flowlock.Transition("reopen", source="closed", target="open"),
            flowlock.Transition("boom", source="open", target="open", effect=boom),
            flowlock.Transition("huge", source="open", target="open", effect=huge),
        ],
    )


WORKFLOWS = {"counter": counter()}
LIMIT = 1024


@st.composite
def calls(draw: st.DrawFn, instance_id: str = "c") -> Call:
    return Call(
        instance_id=instance_id,
        event=draw(st.sampled_from(["add", "add", "close", "reopen", "boom", "huge", "nope"])),
        payload={"n": draw(st.integers(-1, 3))},
        actor=draw(st.sampled_from([None, "ann", "bob"])),
        request_id=draw(st.sampled_from([None, None, "r1", "r2", "r3", "r4"])),
        expected_version=draw(st.sampled_from([None, None, 1, 2, 3, 4])),
        strategy="optimistic",
    )


def _key(answer: object) -> object:
    """What must agree between a batch and one-by-one: the entry, the idempotent instance, or the
    error's type and message."""
    if isinstance(answer, Exception):
        return (type(answer).__name__, str(answer))
    if isinstance(answer, Idempotent):
        return ("idempotent", answer.instance)
    return answer


def one_by_one(
    start: Instance, history: Sequence[HistoryEntry], batch: Sequence[Call]
) -> tuple[list[object], list[HistoryEntry]]:
    """The reference: each call decided on the state the previous ones left, with the request ids
    of the history so far."""
    state, written, answers = start, list(history), []
    for call in batch:
        rid = call.request_id
        priors = {h.request_id: h for h in written if rid is not None and h.request_id == rid}
        try:
            decided: object = decide(
                WORKFLOWS, Snapshot(state, priors), call, max_payload_bytes=LIMIT
            )
        except flowlock.FlowlockError as exc:
            decided = exc
        if isinstance(decided, HistoryEntry):
            written.append(decided)
            state = state.evolve(
                state=decided.to_state,
                version=decided.version,
                data=decided.data,
                last_event=decided.event,
                stay_version=decided.version if decided.enters else state.stay_version,
            )
        answers.append(_key(decided))
    return answers, written[len(history) :]


@settings(max_examples=300, deadline=None)
@given(st.lists(calls(), min_size=1, max_size=12), st.lists(calls(), max_size=4))
def test_decide_batch_equals_one_by_one(batch: list[Call], before: list[Call]) -> None:
    """The pure batch step: the same decisions and entries as deciding the calls in turn, also
    with request ids already in the history (``priors``)."""
    start = Instance("c", "counter", "open", 1, {"n": 0})
    _, history = one_by_one(start, [], before)
    state = start
    for h in history:
        state = state.evolve(
            state=h.to_state,
            version=h.version,
            data=h.data,
            last_event=h.event,
            stay_version=h.version if h.enters else state.stay_version,
        )
    priors = {h.request_id: h for h in history if h.request_id is not None}
    wanted = {c.request_id for c in batch if c.request_id is not None}
    snap = Snapshot(state, priors={k: v for k, v in priors.items() if k in wanted})
    decided = decide_batch(WORKFLOWS, snap, tuple(batch), max_payload_bytes=LIMIT)
    expected, entries = one_by_one(state, history, batch)
    assert [_key(d) for d in decided.decisions] == expected
    assert list(decided.entries) == entries
    assert [e.version for e in decided.entries] == list(
        range(state.version + 1, state.version + 1 + len(entries))
    )


def _outcome_key(answer: object) -> object:
    if isinstance(answer, BaseException):
        return (type(answer).__name__, str(answer))
    assert isinstance(answer, flowlock.Outcome)
    inst = answer.instance
    return (answer.applied, answer.idempotent, inst.state, inst.version, dict(inst.data))


def _history_key(history: Sequence[HistoryEntry]) -> list[object]:
    # Fencing tokens are left out: a batch takes one lease where the calls one by one take one
    # each, so the numbers differ (the checker holds them to rising, on every store).
    return [dataclasses.replace(h, at=None, fencing_token=None) for h in history]


async def _fire(eng: flowlock.Engine, call: Call, strategy: str) -> flowlock.Outcome:
    return await eng.fire(
        call.instance_id,
        call.event,
        actor=call.actor,
        request_id=call.request_id,
        expected_version=call.expected_version,
        payload=call.payload,
        strategy=strategy,
    )


STRATEGIES = ["optimistic", "pessimistic", "distributed", "adaptive"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(calls(), min_size=2, max_size=12))
def test_a_batch_through_the_engine_equals_the_calls_one_by_one(
    strategy: str, batch: list[Call]
) -> None:
    """Fired concurrently (the first runs alone, the rest queue and run as one batch) the calls
    get the outcomes, errors and history of the same calls fired one by one in that order."""

    async def run(batching: bool) -> tuple[list[object], list[object], list[int]]:
        eng = flowlock.Engine(
            MemoryStore(),
            locks=MemoryLocks(),
            batching=batching,
            max_payload_bytes=LIMIT,
        )
        async with eng:
            await eng.register(counter())
            await eng.create("counter", instance_id="c", data={"n": 0})
            if batching:
                answers = await asyncio.gather(
                    *(_fire(eng, c, strategy) for c in batch), return_exceptions=True
                )
            else:
                answers = []
                for c in batch:
                    try:
                        answers.append(await _fire(eng, c, strategy))
                    except flowlock.FlowlockError as exc:
                        answers.append(exc)
            sizes = [a.batch_size for a in answers if isinstance(a, flowlock.Outcome)]
            return [_outcome_key(a) for a in answers], _history_key(await eng.history("c")), sizes

    batched, batched_history, sizes = asyncio.run(run(True))
    alone, alone_history, _ = asyncio.run(run(False))
    assert batched == alone
    assert batched_history == alone_history
    assert all(size in (1, len(batch) - 1) for size in sizes)


# -- behaviour -----------------------------------------------------------------------------------


class GatedStore(MemoryStore):
    """The memory store whose writes wait at a gate the test opens: a write in flight, held."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()
        self.commits: list[int] = []
        self.batches_only = False  # hold only the writes of batches (more than one entry)

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        size = len(entries)
        self.commits.append(size)
        if not self.gate.is_set() and (size > 1 or not self.batches_only):
            self.waiting.set()
            await self.gate.wait()
        return await super().commit(entries)


async def _held(eng: flowlock.Engine, store: GatedStore, first: asyncio.Task[Any]) -> None:
    """Wait until ``first``'s write is held at the gate."""
    async with asyncio.timeout(BOUND):
        await store.waiting.wait()
    assert not first.done()


@pytest.fixture
async def gated() -> Any:
    store = GatedStore()
    async with flowlock.Engine(store) as eng:
        await eng.register(examples.approval())
        await eng.register(counter())
        await eng.create("counter", instance_id="c", data={"n": 0})
        yield eng, store


async def _add(eng: flowlock.Engine, rid: str, **kw: Any) -> flowlock.Outcome:
    return await eng.fire("c", "add", payload={"n": 1}, request_id=rid, **kw)


async def test_queued_calls_share_one_write_and_report_its_size(gated: Any) -> None:
    eng, store = gated
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "r0"))
    await _held(eng, store, first)
    rest = [asyncio.create_task(_add(eng, f"r{i}")) for i in range(1, 10)]
    await asyncio.sleep(0)
    store.gate.set()
    async with asyncio.timeout(BOUND):
        outcomes = await asyncio.gather(first, *rest)
    assert [o.batch_size for o in outcomes] == [1] + [9] * 9
    assert all(o.applied for o in outcomes)
    # Each caller sees the instance as its own transition left it, in arrival order.
    assert [o.instance.version for o in outcomes] == list(range(2, 12))
    assert [o.instance.data["n"] for o in outcomes] == list(range(1, 11))
    assert store.commits == [1, 9]
    history = await eng.history("c")
    assert [h.request_id for h in history] == [f"r{i}" for i in range(10)]
    assert len({h.at for h in history[1:]}) == 1  # one commit wrote the nine
    assert outcomes[-1].instance.updated_at == history[-1].at
    assert await _clean(eng, "c")


async def _clean(eng: flowlock.Engine, instance_id: str, applied: int | None = None) -> bool:
    """The exactly-once checker's verdict on the instance and its history."""
    verdict = check(
        await eng.get(instance_id), await eng.history(instance_id), expected_applied=applied
    )
    return verdict.ok


async def test_each_call_of_a_batch_gets_its_own_error(gated: Any) -> None:
    """A refusal in the middle of a batch is that caller's alone; the calls after it are decided
    on the state the refused call did not change."""
    eng, store = gated
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "a"))
    await _held(eng, store, first)
    rest = [
        asyncio.create_task(_add(eng, "b")),
        asyncio.create_task(eng.fire("c", "add", payload={"n": 0})),  # the guard refuses
        asyncio.create_task(eng.fire("c", "reopen")),  # not allowed from open
        asyncio.create_task(eng.fire("c", "add", payload={"n": 5}, expected_version=3)),
        asyncio.create_task(eng.fire("c", "add", payload={"n": 5}, expected_version=9)),
        asyncio.create_task(_add(eng, "a")),  # applied earlier by the first: idempotent
        asyncio.create_task(eng.fire("c", "close", request_id="a")),  # the key reused
    ]
    await asyncio.sleep(0)
    store.gate.set()
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
    kinds = [type(a).__name__ for a in answers]
    assert kinds == [
        "Outcome",
        "Outcome",
        "GuardRejected",
        "TransitionNotAllowed",
        "Outcome",
        "VersionMismatch",
        "Outcome",
        "IdempotencyKeyReused",
    ]
    fourth, sixth = answers[4], answers[6]
    assert isinstance(fourth, flowlock.Outcome) and isinstance(sixth, flowlock.Outcome)
    assert fourth.instance.version == 4 and fourth.instance.data["n"] == 7
    assert sixth.idempotent and sixth.instance.version == 2
    assert isinstance(answers[5], flowlock.VersionMismatch) and answers[5].current == 4
    assert [h.version for h in await eng.history("c")] == [2, 3, 4]


async def test_a_cancelled_queued_caller_leaves_the_batch(gated: Any) -> None:
    eng, store = gated
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "r0"))
    await _held(eng, store, first)
    rest = [asyncio.create_task(_add(eng, f"r{i}")) for i in range(1, 5)]
    await asyncio.sleep(0)
    rest[1].cancel()
    store.gate.set()
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
    assert isinstance(answers[2], asyncio.CancelledError)
    assert [h.request_id for h in await eng.history("c")] == ["r0", "r1", "r3", "r4"]


async def test_cancelling_the_caller_that_runs_alone_does_not_stop_the_queued_ones(
    gated: Any,
) -> None:
    eng, store = gated
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "r0"))
    await _held(eng, store, first)
    rest = [asyncio.create_task(_add(eng, f"r{i}")) for i in range(1, 5)]
    await asyncio.sleep(0)
    first.cancel()
    store.gate.set()
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
    assert isinstance(answers[0], asyncio.CancelledError)
    assert all(isinstance(a, flowlock.Outcome) and a.applied for a in answers[1:])
    assert [h.request_id for h in await eng.history("c")] == ["r1", "r2", "r3", "r4"]


async def test_cancelling_a_caller_whose_batch_is_in_flight_stops_nobody(gated: Any) -> None:
    """The batch was taken: it is written for everyone, the cancelled caller only loses its
    answer (a retry under its request id answers idempotently)."""
    eng, store = gated
    store.batches_only = True  # the first call's write passes; the batch's is held
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "r0"))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(_add(eng, f"r{i}")) for i in range(1, 4)]
    async with asyncio.timeout(BOUND):
        await first
        await store.waiting.wait()
    rest[0].cancel()
    store.gate.set()
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(*rest, return_exceptions=True)
    assert isinstance(answers[0], asyncio.CancelledError)
    assert all(isinstance(a, flowlock.Outcome) for a in answers[1:])
    assert [h.request_id for h in await eng.history("c")] == ["r0", "r1", "r2", "r3"]
    again = await _add(eng, "r1")
    assert again.idempotent and again.instance.version == 3


async def test_closing_the_engine_answers_every_queued_call(gated: Any) -> None:
    eng, store = gated
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "r0"))
    await _held(eng, store, first)
    rest = [asyncio.create_task(_add(eng, f"r{i}")) for i in range(1, 5)]
    await asyncio.sleep(0)
    closing = asyncio.create_task(eng.aclose())
    await asyncio.sleep(0)
    store.gate.set()
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        await closing
    assert all(isinstance(a, flowlock.Outcome) for a in answers)


async def test_max_batch_bounds_a_batch(gated: Any) -> None:
    _, store = gated
    async with flowlock.Engine(store, max_batch=3) as small:
        await small.register(counter())
        store.gate.clear()
        first = asyncio.create_task(_add(small, "r0"))
        await _held(small, store, first)
        rest = [asyncio.create_task(_add(small, f"r{i}")) for i in range(1, 8)]
        await asyncio.sleep(0)
        store.gate.set()
        async with asyncio.timeout(BOUND):
            outcomes = await asyncio.gather(first, *rest)
    assert [o.batch_size for o in outcomes] == [1] + [3] * 6 + [1]
    assert store.commits == [1, 3, 3, 1]


async def test_calls_under_different_strategies_are_batched_apart(gated: Any) -> None:
    eng, store = gated
    store.gate.clear()
    first = asyncio.create_task(_add(eng, "r0"))
    await _held(eng, store, first)
    optimistic = [asyncio.create_task(_add(eng, f"o{i}")) for i in range(3)]
    pessimistic = [
        asyncio.create_task(_add(eng, f"p{i}", strategy="pessimistic")) for i in range(3)
    ]
    await asyncio.sleep(0)
    store.gate.set()
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(first, *optimistic, *pessimistic)
    assert [a.batch_size for a in answers[1:4]] == [3, 3, 3]
    assert {a.strategy for a in answers[4:]} == {"pessimistic"}
    history = await eng.history("c")
    assert sorted(h.request_id or "" for h in history) == sorted(
        ["r0", "o0", "o1", "o2", "p0", "p1", "p2"]
    )
    assert await _clean(eng, "c")


async def test_batching_off_runs_every_call_alone() -> None:
    async with flowlock.Engine(MemoryStore(), batching=False) as eng:
        await eng.register(counter())
        await eng.create("counter", instance_id="c", data={"n": 0})
        outcomes = await asyncio.gather(
            *(_add(eng, f"r{i}") for i in range(20)), return_exceptions=True
        )
    assert all(o.batch_size == 1 for o in outcomes if isinstance(o, flowlock.Outcome))


class LosingStore(MemoryStore):
    """Every compare-and-swap loses, as if another process always wrote first."""

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        await super().read(entries[0].instance_id, ())
        return None


async def test_retries_exhausted_names_each_callers_own_event() -> None:
    store = LosingStore()
    opt = flowlock.Optimistic(max_attempts=2, backoff_base=0.0, backoff_cap=0.0)
    async with flowlock.Engine(store, strategies=[opt]) as eng:
        await eng.register(counter())
        await eng.create("counter", instance_id="c", data={"n": 0})
        answers = await asyncio.gather(
            _add(eng, "a", strategy="optimistic"),
            eng.fire("c", "close", strategy="optimistic"),
            _add(eng, "b", strategy="optimistic"),
            return_exceptions=True,
        )
    assert all(isinstance(a, flowlock.ConflictRetriesExhausted) for a in answers)
    assert [a.event for a in answers] == ["add", "close", "add"]  # type: ignore[union-attr]


async def test_a_storm_is_answered_from_one_read_without_a_write_per_caller(gated: Any) -> None:
    eng, store = gated
    await eng.create("approval", instance_id="a")
    store.gate.clear()
    first = asyncio.create_task(eng.fire("a", "approve", actor="admin-0"))
    await _held(eng, store, first)
    rest = [
        asyncio.create_task(eng.fire("a", "approve", actor=f"admin-{i}")) for i in range(1, 100)
    ]
    await asyncio.sleep(0)
    store.gate.set()
    async with asyncio.timeout(BOUND):
        outcomes = await asyncio.gather(first, *rest)
    assert outcomes[0].applied and all(o.idempotent for o in outcomes[1:])
    assert store.commits == [1]  # the 99 others wrote nothing
    assert len(await eng.history("a")) == 1


@pytest.mark.parametrize("bad", [{"batching": "yes"}, {"max_batch": 0}, {"max_batch": 10**6}])
def test_bad_batching_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(flowlock.InvalidInput):
        flowlock.Engine(MemoryStore(), **bad)
