"""The outbox dispatcher on the memory store: delivery, redelivery, order, concurrency,
retries and dead messages, Then chains, retention, closing, metrics, spans, and silence while
idle."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import flowlock
from flowlock.core.outbox import OUTBOX_ACTOR
from flowlock.outbox.dispatcher import Dispatcher, backoff_delay
from flowlock.stores.base import OutboxStore
from flowlock.stores.memory import MemoryStore
from flowlock.stores.sqlite import SqliteStore
from lock_probes import wait_until
from outbox_kit import noted, noter, shop, status_is
from span_probes import attrs, recording, span_id

FAST = (0.001, 0.01)  # outbox_backoff for tests: retries within milliseconds


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL on each store that runs without a server."""
    return "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'outbox.db'}"


def _dispatcher(engine: flowlock.Engine) -> Dispatcher:
    found = engine.dispatcher
    assert found is not None
    return found


# -- delivery --------------------------------------------------------------------------------


async def test_an_async_handler_gets_the_message_and_it_is_done(url: str) -> None:
    """An async handler receives kind, key, instance, payload, attempt; None marks it done."""
    got: list[flowlock.Message] = []

    async def handler(message: flowlock.Message) -> None:
        got.append(message)

    async with flowlock.connect(url) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler)  # after open
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "done")
    [message] = got
    assert (message.kind, message.key, message.instance_id) == ("k", "n1:2:0", "n1")
    assert (dict(message.payload), message.attempt, message.fencing_token) == ({"i": 0}, 1, None)
    assert message.status == "running"


async def test_a_sync_handler_runs_in_a_worker_thread() -> None:
    """A plain function is run in a thread, not on the event loop; registered before open."""
    threads: list[str] = []

    def handler(message: flowlock.Message) -> None:
        threads.append(threading.current_thread().name)

    engine = flowlock.connect("memory://")
    engine.on_emit("k", handler)
    async with engine:
        await engine.register(noter())
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "done")
    assert len(threads) == 1
    assert threads[0] != threading.main_thread().name


async def test_a_message_held_by_a_dead_claimer_is_taken_over_after_its_lease(url: str) -> None:
    """At least once: a claim whose holder died runs out, and the message is delivered again
    under the same key, as attempt 2."""
    got: list[flowlock.Message] = []

    async def handler(message: flowlock.Message) -> None:
        got.append(message)

    async with flowlock.connect(url) as engine:
        await engine.register(noter())
        await noted(engine, "n1")
        store = engine.store
        assert isinstance(store, OutboxStore)
        [held] = await store.claim_messages({"k": 1}, lease=0.3, owner="a-process-that-died")
        engine.on_emit("k", handler)
        await asyncio.sleep(0.1)
        assert got == []  # the claim still holds
        assert (await engine.message(held.key)).status == "running"
        await status_is(engine, held.key, "done")
    [message] = got
    assert (message.key, message.attempt) == (held.key, 2)


async def test_messages_of_one_instance_are_delivered_in_order(url: str) -> None:
    """Per instance, messages go one at a time in (version, n) order, whatever the
    concurrency; instances go side by side."""
    seen: dict[str, list[tuple[int, int]]] = {}
    running: set[str] = set()
    overlaps: list[str] = []

    async def handler(message: flowlock.Message) -> None:
        if message.instance_id in running:
            overlaps.append(message.key)
        running.add(message.instance_id)
        await asyncio.sleep(0.001 * (message.n % 3))
        seen.setdefault(message.instance_id, []).append((message.version, message.n))
        running.discard(message.instance_id)

    ids = [f"i{n}" for n in range(5)]
    async with flowlock.connect(url) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler, concurrency=8)
        for _ in range(4):
            for iid in ids:
                await noted(engine, iid, count=3)

        async def all_seen() -> bool:
            return sum(map(len, seen.values())) == 5 * 4 * 3

        await wait_until(all_seen)
    assert overlaps == []
    for iid in ids:
        assert seen[iid] == [(v, n) for v in range(2, 6) for n in range(3)]


async def test_concurrency_per_kind_is_bounded(url: str) -> None:
    """With concurrency=3, at most three messages of the kind are in flight at once, and
    three are; another kind has its own bound."""
    gate = asyncio.Event()
    flight = {"k": 0, "other": 0}
    peak = {"k": 0, "other": 0}

    async def handler(message: flowlock.Message) -> None:
        flight[message.kind] += 1
        peak[message.kind] = max(peak[message.kind], flight[message.kind])
        await gate.wait()
        flight[message.kind] -= 1

    async with flowlock.connect(url) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler, concurrency=3)
        engine.on_emit("other", handler, concurrency=2)
        for n in range(12):
            await noted(engine, f"i{n}", kind="k" if n < 8 else "other")

        async def full() -> bool:
            return flight == {"k": 3, "other": 2}

        await wait_until(full)
        await asyncio.sleep(0.2)  # time for a fourth to start, were the bound broken
        assert peak == {"k": 3, "other": 2}
        gate.set()

        async def done() -> bool:
            found = await engine.find_messages(status="done")
            return len(found) == 12

        await wait_until(done)
    assert peak == {"k": 3, "other": 2}


# -- failures --------------------------------------------------------------------------------


async def test_a_handler_that_always_fails_ends_dead_and_a_retry_by_hand_delivers_it(
    url: str,
) -> None:
    """Retried with backoff up to max_attempts, then dead with its last error; retry_message
    delivers it again with a fresh count."""
    calls: list[int] = []
    broken = True

    async def handler(message: flowlock.Message) -> None:
        calls.append(message.attempt)
        if broken:
            raise ValueError("the receiver is down")

    async with flowlock.connect(url, outbox_backoff=FAST) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler, max_attempts=4)
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "dead")
        dead = await engine.message("n1:2:0")
        assert calls == [1, 2, 3, 4]
        assert dead.attempts == 4
        assert dead.last_error is not None
        assert "ValueError: the receiver is down" in dead.last_error
        assert "attempt 4 of 4" in dead.last_error
        await asyncio.sleep(0.1)
        assert calls == [1, 2, 3, 4]  # dead stays dead
        broken = False
        await engine.retry_message("n1:2:0")
        await status_is(engine, "n1:2:0", "done")
        assert calls == [1, 2, 3, 4, 1]


async def test_delivery_refused_is_dead_at_once(url: str) -> None:
    """A handler raising DeliveryRefused is not retried."""
    calls: list[int] = []

    async def handler(message: flowlock.Message) -> None:
        calls.append(message.attempt)
        raise flowlock.DeliveryRefused("the receiver said 400: no such customer")

    async with flowlock.connect(url, outbox_backoff=FAST) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler)
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "dead")
        dead = await engine.message("n1:2:0")
    assert calls == [1]
    assert dead.last_error is not None and "no such customer" in dead.last_error


async def test_a_handler_past_its_timeout_is_retried(url: str) -> None:
    """A handler that takes longer than its timeout is cut off and tried again."""
    calls: list[int] = []

    async def handler(message: flowlock.Message) -> None:
        calls.append(message.attempt)
        if message.attempt == 1:
            await asyncio.sleep(5)

    async with flowlock.connect(url, outbox_backoff=FAST) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler, timeout=0.1)
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "done")
        assert calls == [1, 2]
        # The first delivery's error was cleared by nothing: kept for the operator.
        assert "timeout (0.1 s)" in ((await engine.message("n1:2:0")).last_error or "")


async def test_a_handler_that_returns_something_else_is_dead() -> None:
    """A handler returns None or Then; anything else is a bug, and the message dead."""

    async def handler(message: flowlock.Message) -> Any:
        return {"not": "a Then"}

    async with flowlock.connect("memory://", outbox_backoff=FAST) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler)
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "dead")
        assert "returned dict" in ((await engine.message("n1:2:0")).last_error or "")


def test_backoff_is_full_jitter_doubling_to_a_cap() -> None:
    """The wait is draw x base x 2^(attempt-1), capped; Retry-After is a floor, capped too."""
    assert backoff_delay(1, (1.0, 300.0), draw=lambda: 1.0) == 1.0
    assert backoff_delay(3, (1.0, 300.0), draw=lambda: 1.0) == 4.0
    assert backoff_delay(3, (1.0, 300.0), draw=lambda: 0.5) == 2.0
    assert backoff_delay(20, (1.0, 300.0), draw=lambda: 1.0) == 300.0
    assert backoff_delay(1000, (1.0, 300.0), draw=lambda: 1.0) == 300.0
    assert backoff_delay(1, (1.0, 300.0), draw=lambda: 0.0) == 0.0
    assert backoff_delay(1, (1.0, 300.0), 7.0, draw=lambda: 0.0) == 7.0
    assert backoff_delay(1, (1.0, 300.0), 9999.0, draw=lambda: 0.0) == 300.0


# -- Then ------------------------------------------------------------------------------------


def _first_marks_lost(keys: Sequence[str], lost: set[str]) -> list[str]:
    """The keys whose done mark goes through: each key's first one is lost."""
    kept = [k for k in keys if k in lost]
    lost.update(keys)
    return kept


class LosesDoneMarks(MemoryStore):
    """A memory store that loses the first done mark of every message, as if the engine died
    after the handler (and its Then) and before writing "done": each message is delivered
    again once its claim runs out."""

    lost: set[str]

    async def finish_messages(self, keys: Sequence[str]) -> int:
        return await super().finish_messages(_first_marks_lost(keys, self.lost))


class SqliteLosesDoneMarks(SqliteStore):
    """The same on SQLite."""

    lost: set[str]

    async def finish_messages(self, keys: Sequence[str]) -> int:
        return await super().finish_messages(_first_marks_lost(keys, self.lost))


async def test_a_redelivered_then_with_another_payload_is_done_not_dead() -> None:
    """A handler that builds its Then anew on each delivery (a new id): the redelivery's Then
    is answered by the first one's application under the key, so the message is done, once."""
    store = MemoryStore()
    runs: list[int] = []

    async def charge(message: flowlock.Message) -> flowlock.Then:
        runs.append(message.attempt)
        return flowlock.Then("charged", payload={"charge": f"ch-{len(runs)}"})

    async with flowlock.Engine(store, outbox=False) as caller:
        await caller.register(shop())
        await caller.create("shop", instance_id="o1")
        await caller.fire("o1", "reserve")
        [held] = await store.claim_messages({"charge": 1}, lease=60.0, owner="dead")
        # The first delivery fires its Then under the key (the dispatcher's own path), then
        # dies before its done mark.
        await caller._fire_then(held, await charge(held))
    async with flowlock.Engine(store, outbox_backoff=FAST, outbox_lease=1.0) as engine:
        await engine.register(shop())
        engine.on_emit("charge", charge, timeout=0.5)
        await store.release_message(held, "dead")
        await status_is(engine, "o1:2:0", "done")
        history = await engine.history("o1")
    assert [h.event for h in history] == ["reserve", "charged"]
    assert len(runs) == 2


async def test_a_then_chain_applies_exactly_once_when_each_message_is_delivered_twice(
    url: str,
) -> None:
    """reserve -> charge -> ship: each handler returns a Then, fired under the message key;
    delivered twice, each Then applies once (the second answers idempotent)."""
    calls: list[tuple[str, int]] = []

    async def charge(message: flowlock.Message) -> flowlock.Then:
        calls.append((message.kind, message.attempt))
        return flowlock.Then("charged", {"amount": 5})

    async def ship(message: flowlock.Message) -> flowlock.Then:
        calls.append((message.kind, message.attempt))
        return flowlock.Then("shipped", actor="warehouse")

    store = LosesDoneMarks() if url == "memory://" else SqliteLosesDoneMarks(url[10:])
    store.lost = set()
    async with flowlock.Engine(store, outbox_lease=0.3) as engine:
        await engine.register(shop())
        engine.on_emit("charge", charge, timeout=0.2)
        engine.on_emit("ship", ship, timeout=0.2)
        await engine.create("shop", instance_id="o1")
        await engine.fire("o1", "reserve")
        await status_is(engine, "o1:3:0", "done")
        history = await engine.history("o1")
    assert calls == [("charge", 1), ("charge", 2), ("ship", 1), ("ship", 2)]
    assert [(h.event, h.version, h.request_id, h.actor) for h in history] == [
        ("reserve", 2, None, None),
        ("charged", 3, "o1:2:0", OUTBOX_ACTOR),
        ("shipped", 4, "o1:3:0", "warehouse"),
    ]
    assert dict(history[1].payload) == {"amount": 5}


async def test_a_then_the_workflow_refuses_is_dead_at_once(url: str) -> None:
    """An unknown event or one not allowed from the state can never apply: dead, one attempt."""

    async def handler(message: flowlock.Message) -> flowlock.Then:
        return flowlock.Then("no-such-event" if message.n == 0 else "reserve")

    async with flowlock.connect(url, outbox_backoff=FAST) as engine:
        await engine.register(shop())
        engine.on_emit("charge", handler)
        await engine.create("shop", instance_id="o1")
        await engine.fire("o1", "reserve")
        await status_is(engine, "o1:2:0", "dead")
        dead = await engine.message("o1:2:0")
        assert dead.attempts == 1
        assert "Then('no-such-event') was refused" in (dead.last_error or "")
        assert (await engine.get("o1")).state == "reserved"


async def test_a_then_into_a_paused_instance_waits_without_dying_and_applies_on_resume(
    url: str,
) -> None:
    """The handler's Then meets a paused instance: the message is due again later, its attempt
    not counted, so it outlives max_attempts (the handler runs again each time: it is
    idempotent by the message key), and the Then applies once the instance is resumed."""
    calls: list[int] = []

    async def handler(message: flowlock.Message) -> flowlock.Then:
        calls.append(message.attempt)
        return flowlock.Then("charged")

    async with flowlock.connect(url, outbox_backoff=FAST) as engine:
        await engine.register(shop())
        await engine.create("shop", instance_id="o1")
        await engine.fire("o1", "reserve")
        await engine.pause("o1", reason="fraud check", actor="ops")
        engine.on_emit("charge", handler, max_attempts=3)
        await wait_until(lambda: len(calls) >= 10, what="ten deliveries while paused")
        waiting = await engine.message("o1:2:0")
        assert waiting.status in ("pending", "running"), waiting  # running: in flight now
        assert waiting.attempts <= 1 and set(calls) == {1}  # never counted up
        assert "InstancePaused" in (waiting.last_error or "")
        assert (await engine.get("o1")).state == "reserved"
        await engine.resume("o1", actor="ops")
        done = await status_is(engine, "o1:2:0", "done")
        assert done.attempts == 1
        assert (await engine.get("o1")).state == "charged"
        (charged,) = [e for e in await engine.history("o1") if e.event == "charged"]
        assert charged.request_id is not None and "o1:2:0" in charged.request_id


async def test_a_then_for_a_workflow_this_engine_does_not_know_is_retried() -> None:
    """A delivery-only engine (a handler, no workflow) dispatches at once; a Then whose
    workflow this engine has not registered (another engine's, or not yet) is retried, not
    dead, and applies once the workflow is registered."""
    store = MemoryStore()
    async with flowlock.Engine(store) as first:
        await first.register(shop())
        await first.create("shop", instance_id="o1")
        await first.fire("o1", "reserve")

    async def handler(message: flowlock.Message) -> flowlock.Then:
        return flowlock.Then("charged")

    async with flowlock.Engine(store, outbox_backoff=FAST) as second:
        second.on_emit("charge", handler, max_attempts=1000)
        assert _dispatcher(second).running

        async def retried() -> bool:
            shown = await second.message("o1:2:0")
            return shown.status != "dead" and "UnknownWorkflow" in (shown.last_error or "")

        await wait_until(retried)
        await second.register(shop())
        await status_is(second, "o1:2:0", "done")
        assert (await second.get("o1")).state == "charged"


# -- retention, closing, idling ----------------------------------------------------------------


async def test_done_messages_older_than_the_retention_are_purged(url: str) -> None:
    """The dispatcher deletes done messages older than outbox_retention; None keeps them."""

    async def handler(message: flowlock.Message) -> None:
        return None

    retention = timedelta(milliseconds=100)
    async with flowlock.connect(url, outbox_retention=retention) as engine:
        await engine.register(noter())
        _dispatcher(engine).purge_every = 0.05
        engine.on_emit("k", handler)
        await noted(engine, "n1", count=3)
        await status_is(engine, "n1:2:2", "done")
        await asyncio.sleep(0.2)
        await noted(engine, "n1")  # wakes the dispatcher, which purges the first three

        async def purged() -> bool:
            return [m.key for m in await engine.messages("n1")] == ["n1:3:0"]

        await wait_until(purged)
    async with flowlock.connect(url, outbox_retention=None) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler)
        await noted(engine, "kept")
        await status_is(engine, "kept:2:0", "done")
        assert await _dispatcher(engine).purge() == 0
        assert len(await engine.messages("kept")) == 1


async def test_closing_gives_back_the_claims_of_deliveries_it_cuts_short() -> None:
    """A closing engine waits close_grace for deliveries in flight, cancels the rest and gives
    their claims back: another engine delivers them at once, not a lease later."""
    started = asyncio.Event()

    async def hangs(message: flowlock.Message) -> None:
        started.set()
        await asyncio.sleep(60)

    got: list[int] = []

    async def works(message: flowlock.Message) -> None:
        got.append(message.attempt)

    store = MemoryStore()
    first = flowlock.Engine(store)
    async with first:
        await first.register(noter())
        first.on_emit("k", hangs)
        _dispatcher(first).close_grace = 0.1
        await noted(first, "n1")
        await asyncio.wait_for(started.wait(), 5)
    async with flowlock.Engine(store) as second:
        await second.register(noter())
        shown = await second.message("n1:2:0")
        assert (shown.status, shown.attempts) == ("pending", 1)
        second.on_emit("k", works)
        await status_is(second, "n1:2:0", "done")
    assert got == [2]


class Counting(MemoryStore):
    """A memory store that counts the outbox statements the dispatcher sends."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.fail_next_due = 0

    async def claim_messages(
        self, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[flowlock.Message]:
        self.calls += 1
        return await super().claim_messages(kinds, lease=lease, owner=owner, run=run)

    async def finish_messages(self, keys: Sequence[str]) -> int:
        self.calls += 1
        return await super().finish_messages(keys)

    async def next_message_due(self, kinds: Sequence[str]) -> float | None:
        self.calls += 1
        if self.fail_next_due:
            self.fail_next_due -= 1
            raise RuntimeError("an unwrapped driver error")
        return await super().next_message_due(kinds)

    async def count_messages(self) -> Mapping[str, int]:
        self.calls += 1
        return await super().count_messages()

    async def purge_messages(self, older_than: float, limit: int) -> int:
        self.calls += 1
        return await super().purge_messages(older_than, limit)


async def test_an_idle_dispatcher_sends_no_statement() -> None:
    """Once nothing is pending, the dispatcher sleeps on the pending signal: zero statements,
    its counts and purges included (they run only while it is awake)."""

    async def handler(message: flowlock.Message) -> None:
        return None

    store = Counting()
    metrics = flowlock.Metrics(registry=CollectorRegistry())
    async with flowlock.Engine(store, metrics=metrics) as engine:
        await engine.register(noter())
        dispatcher = _dispatcher(engine)
        dispatcher.count_every = dispatcher.purge_every = 0.1
        engine.on_emit("k", handler)
        await noted(engine, "n1", count=5)
        await status_is(engine, "n1:2:4", "done")
        await asyncio.sleep(0.3)
        before = store.calls
        await asyncio.sleep(1.0)
        assert store.calls == before
        assert dispatcher.running
        await noted(engine, "n1")  # and it wakes at once for the next message
        await status_is(engine, "n1:3:0", "done")
        assert store.calls > before


async def test_an_unexpected_error_is_logged_and_the_dispatcher_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An error that is not a flowlock error never stops the dispatcher."""
    got: list[str] = []

    async def handler(message: flowlock.Message) -> None:
        got.append(message.key)

    store = Counting()
    store.fail_next_due = 2
    async with flowlock.Engine(store) as engine:
        await engine.register(noter())
        engine.on_emit("k", handler)
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "done")
        assert _dispatcher(engine).running
    assert "an unwrapped driver error" in caplog.text
    assert got == ["n1:2:0"]


# -- metrics and spans -----------------------------------------------------------------------


async def test_deliveries_are_counted_with_their_lag_and_the_gauges(url: str) -> None:
    """flowlock_outbox_attempts_total, _deliveries_total, _dispatch_lag_seconds, _pending and
    _dead move."""
    registry = CollectorRegistry()
    metrics = flowlock.Metrics(registry=registry)

    async def handler(message: flowlock.Message) -> None:
        if message.n == 1:
            raise flowlock.DeliveryRefused("no")

    async with flowlock.connect(url, metrics=metrics, outbox_backoff=FAST) as engine:
        await engine.register(noter())
        _dispatcher(engine).count_every = 0.0
        engine.on_emit("k", handler)
        await noted(engine, "n1", count=2)
        await status_is(engine, "n1:2:1", "dead")
        await noted(engine, "n2")  # a round after the dead one: the gauges count it
        await status_is(engine, "n2:2:0", "done")
        sample = registry.get_sample_value

        async def counted() -> bool:
            return sample("flowlock_outbox_dead") == 1.0

        await wait_until(counted)
    assert sample("flowlock_outbox_attempts_total", {"kind": "k"}) == 3
    assert sample("flowlock_outbox_deliveries_total", {"kind": "k", "outcome": "done"}) == 2
    assert sample("flowlock_outbox_deliveries_total", {"kind": "k", "outcome": "dead"}) == 1
    assert sample("flowlock_outbox_dispatch_lag_seconds_count", {"kind": "k"}) == 3
    assert sample("flowlock_outbox_pending") is not None


async def test_each_delivery_has_a_span_linked_to_the_emitting_call() -> None:
    """The fire span's traceparent rides on the message; the `flowlock.outbox.deliver` span
    links to it, and the Then's fire span is its child."""

    async def handler(message: flowlock.Message) -> flowlock.Then:
        return flowlock.Then("charged")

    with recording() as spans:
        async with flowlock.connect("memory://") as engine:
            await engine.register(shop())
            await engine.create("shop", instance_id="o1")
            await engine.fire("o1", "reserve")
            message = await engine.message("o1:2:0")
            assert message.trace is not None and message.trace.startswith("00-")
            engine.on_emit("charge", handler)
            await status_is(engine, "o1:2:0", "done")
        [emitting] = [
            s for s in spans.named("flowlock.fire") if attrs(s)["flowlock.event"] == "reserve"
        ]
        deliver = spans.one("flowlock.outbox.deliver")
        seen = attrs(deliver)
        assert seen["flowlock.outbox.kind"] == "charge"
        assert seen["flowlock.outbox.key"] == "o1:2:0"
        assert seen["flowlock.outbox.attempt"] == 1
        assert seen["flowlock.outbox.outcome"] == "then"
        assert deliver.parent is None
        [link] = deliver.links
        assert link.context.span_id == span_id(emitting)
        assert emitting.context is not None
        assert link.context.trace_id == emitting.context.trace_id
        [then_fire] = spans.children(deliver, "flowlock.fire")
        assert attrs(then_fire)["flowlock.event"] == "charged"


async def test_no_trace_is_kept_without_tracing() -> None:
    """Untraced calls leave the message's trace empty."""
    async with flowlock.connect("memory://") as engine:
        await engine.register(noter())
        await noted(engine, "n1")
        assert (await engine.message("n1:2:0")).trace is None


def test_the_sync_engine_delivers_on_its_own_loop_thread() -> None:
    """flowlock.sync.Engine.on_emit: handlers registered before open (sync) and after (async)
    run while the caller's thread does other things; a Then chain completes."""
    import flowlock.sync

    seen: list[str] = []
    shipped = threading.Event()

    def charge(message: flowlock.Message) -> flowlock.Then:
        seen.append(message.key)
        return flowlock.Then("charged")

    async def ship(message: flowlock.Message) -> flowlock.Then:
        seen.append(message.key)
        shipped.set()
        return flowlock.Then("shipped")

    with flowlock.sync.Engine.connect("memory://") as engine:
        engine.on_emit("charge", charge)
        engine.register(shop())
        engine.create("shop", instance_id="o1")
        engine.on_emit("ship", ship)
        engine.fire("o1", "reserve")
        assert shipped.wait(10)
        deadline = time.monotonic() + 10
        while engine.get("o1").state != "shipped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.get("o1").state == "shipped"
    assert seen == ["o1:2:0", "o1:3:0"]
    unopened = flowlock.sync.Engine.connect("memory://")
    try:
        with pytest.raises(flowlock.InvalidInput):
            unopened.on_emit("bad kind", charge)
    finally:
        unopened.close()


async def test_a_then_on_an_instance_with_the_longest_id_applies() -> None:
    """A message key is longer than the instance id; its Then's request id is still taken."""
    iid = "s" * 200

    async def charge(message: flowlock.Message) -> flowlock.Then:
        return flowlock.Then("charged")

    async with flowlock.connect("memory://", outbox_backoff=FAST) as engine:
        await engine.register(shop())
        engine.on_emit("charge", charge)
        await engine.create("shop", instance_id=iid)
        await engine.fire(iid, "reserve")
        await status_is(engine, f"{iid}:2:0", "done")
        [_, then] = await engine.history(iid)
        assert (then.event, then.request_id) == ("charged", f"{iid}:2:0")


# -- runs: an instance's next messages claimed together and delivered in order ------------------


class Claims(MemoryStore):
    """A memory store that notes how many messages each claim of the dispatcher took."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    async def claim_messages(
        self, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[flowlock.Message]:
        got = await super().claim_messages(kinds, lease=lease, owner=owner, run=run)
        if got:
            self.sizes.append(len(got))
        return got


async def test_a_hot_instances_backlog_is_claimed_in_runs_and_delivered_in_order() -> None:
    """Ten pending messages of one instance, runs of at most 4: three claims (4, 4, 2), and the
    handler gets them in order, one at a time, each at its first attempt."""
    got: list[tuple[int, int]] = []
    running: list[str] = []
    overlaps: list[str] = []

    async def handler(message: flowlock.Message) -> None:
        if running:
            overlaps.append(message.key)
        running.append(message.key)
        await asyncio.sleep(0.001)
        got.append((message.n, message.attempt))
        running.remove(message.key)

    store = Claims()
    async with flowlock.Engine(store) as engine:
        await engine.register(noter())
        _dispatcher(engine).run = 4
        await noted(engine, "hot", count=10)
        engine.on_emit("k", handler, concurrency=8)
        await status_is(engine, "hot:2:9", "done")
    assert got == [(n, 1) for n in range(10)]
    assert overlaps == []
    assert store.sizes == [4, 4, 2]


@pytest.mark.parametrize("fails", ["retried", "dead"])
async def test_a_failure_in_a_run_gives_back_the_rest_with_their_attempts(
    url: str, fails: str
) -> None:
    """A message that fails ends its run: the messages behind it are given back at once, their
    attempts counted back, and delivered later in order at their first attempt: after the
    failed one's retry (it is still pending ahead of them), or at once when it is dead."""
    got: list[tuple[int, int]] = []

    async def handler(message: flowlock.Message) -> None:
        got.append((message.n, message.attempt))
        if message.n == 2 and message.attempt == 1:
            if fails == "dead":
                raise flowlock.DeliveryRefused("not this one")
            raise ValueError("the receiver blinked")

    async with flowlock.connect(url, outbox_backoff=FAST) as engine:
        await engine.register(noter())
        _dispatcher(engine).run = 5
        await noted(engine, "n1", count=5)
        engine.on_emit("k", handler)
        await status_is(engine, "n1:2:4", "done")
        shown = {m.n: (m.status, m.attempts) for m in await engine.messages("n1")}
    if fails == "dead":
        assert got == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]
        assert shown[2] == ("dead", 1)
    else:
        assert got == [(0, 1), (1, 1), (2, 1), (2, 2), (3, 1), (4, 1)]
        assert shown[2] == ("done", 2)
    assert [shown[n] for n in (0, 1, 3, 4)] == [("done", 1)] * 4


async def test_closing_gives_back_the_messages_of_a_run_not_begun() -> None:
    """A closing engine lets the delivery in flight finish, begins no further message of its
    run and gives the rest back, their attempts counted back: another engine delivers them,
    in order, at their first attempt."""
    started = asyncio.Event()
    release = asyncio.Event()
    got: list[tuple[int, int]] = []

    async def slow(message: flowlock.Message) -> None:
        got.append((message.n, message.attempt))
        started.set()
        await release.wait()

    async def works(message: flowlock.Message) -> None:
        got.append((message.n, message.attempt))

    store = MemoryStore()
    first = flowlock.Engine(store)
    async with first:
        await first.register(noter())
        _dispatcher(first).run = 4
        await noted(first, "n1", count=4)
        first.on_emit("k", slow)
        await asyncio.wait_for(started.wait(), 5)
        asyncio.get_running_loop().call_later(0.1, release.set)  # lands within close_grace
    async with flowlock.Engine(store) as second:
        await second.register(noter())
        shown = {m.n: (m.status, m.attempts) for m in await second.messages("n1")}
        assert shown == {0: ("done", 1), 1: ("pending", 0), 2: ("pending", 0), 3: ("pending", 0)}
        second.on_emit("k", works)
        await status_is(second, "n1:2:3", "done")
    assert got == [(0, 1), (1, 1), (2, 1), (3, 1)]


async def test_closing_cuts_a_run_short_and_gives_back_the_rest_of_it() -> None:
    """A delivery past close_grace is cancelled and given back with its attempt counted; the
    messages of its run behind it never began and have theirs back."""
    started = asyncio.Event()

    async def hangs(message: flowlock.Message) -> None:
        started.set()
        await asyncio.sleep(60)

    store = MemoryStore()
    async with flowlock.Engine(store) as engine:
        await engine.register(noter())
        _dispatcher(engine).run = 3
        _dispatcher(engine).close_grace = 0.1
        await noted(engine, "n1", count=3)
        engine.on_emit("k", hangs)
        await asyncio.wait_for(started.wait(), 5)
    async with flowlock.Engine(store) as after:
        shown = [(m.status, m.attempts) for m in await after.messages("n1")]
    assert shown == [("pending", 1), ("pending", 0), ("pending", 0)]
