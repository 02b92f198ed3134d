"""``flowlock.sync.Engine``, the blocking engine for threaded code, against real PostgreSQL.

Threads of one process share one engine (32 threads released together by a barrier, more than
the pool's 20 connections, so calls also queue for a connection); a real WSGI server in its own
process serves many concurrent HTTP clients from one engine; each ends with the checker over the
history and the history rows counted with the test's own SQL. Then: the same
error classes and messages as the async engine, EngineClosed after close, a typed error instead
of a deadlock inside an event loop, signature parity, interrupts, the exit hook and forks.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import flowlock
import pg_budget
from conftest import SqlHistory as Counted
from flowlock.checker import OVERSELL, check
from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry
from flowlock.stores.postgres import PostgresStore
from flowlock.sync import Engine as SyncEngine

TESTS = Path(__file__).resolve().parents[1]
THREADS = 32
SqlHistory = Callable[..., Awaitable[Counted]]


def counted(sql_history: SqlHistory) -> Counted:
    """The ``sql_history`` fixture's count, from a test that is not async."""

    async def count() -> Counted:
        return await sql_history()

    return asyncio.run(count())


def sync_engine(pg_url: str, schema: str, **options: Any) -> SyncEngine:
    engine = flowlock.sync.Engine.connect(pg_url, schema=schema, **options)
    engine.register(flowlock.examples.approval())
    engine.register(flowlock.examples.inventory())
    return engine


def no_oversell(data: Mapping[str, Any]) -> str | None:
    stock = data.get("stock", 0)
    return None if stock >= 0 else f"stock went below zero: {stock}"


def verify(
    engine: SyncEngine, sql_history: SqlHistory, applied: Mapping[str, int], **kw: Any
) -> None:
    """The checker over each instance's history, then the history rows counted with SQL."""
    histories: dict[str, list[HistoryEntry]] = {}
    for iid, count in applied.items():
        histories[iid] = engine.history(iid)
        verdict = check(engine.get(iid), histories[iid], expected_applied=count, **kw)
        assert verdict.ok, verdict.violations
    counted(sql_history).assert_matches(histories)


def in_threads(work: Callable[[int, threading.Barrier], list[Any]]) -> list[Any]:
    """``work(thread_no, barrier)`` in THREADS threads at once; every result, errors included."""
    barrier = threading.Barrier(THREADS, timeout=60)
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(work, n, barrier) for n in range(THREADS)]
        return [item for f in futures for item in f.result(timeout=120)]


def attempt(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except flowlock.FlowlockError as exc:
        return exc


# -- many threads, one engine ---------------------------------------------------------------


def test_threads_share_one_engine_two_admins(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """32 threads approve the same request at once, 5 rounds: 1 applied and 31 idempotent per
    round, no error, one history row each."""
    rounds = 5
    with sync_engine(pg_url, pg_schema) as engine:
        for r in range(rounds):
            engine.create("approval", instance_id=f"req-{r}")

        def admin(n: int, barrier: threading.Barrier) -> list[Any]:
            outs = []
            for r in range(rounds):
                barrier.wait()
                outs.append(attempt(partial(engine.fire, f"req-{r}", "approve", actor=f"a{n}")))
            return outs

        outs = in_threads(admin)
        assert all(isinstance(o, flowlock.Outcome) for o in outs), outs[:3]
        for r in range(rounds):
            mine = [o for o in outs if o.instance.id == f"req-{r}"]
            assert len(mine) == THREADS
            assert sum(o.applied for o in mine) == 1
            assert sum(o.idempotent for o in mine) == THREADS - 1
            assert {o.instance.state for o in mine} == {"approved"}
        verify(engine, sql_history, {f"req-{r}": 1 for r in range(rounds)}, initial_state="pending")


def test_threads_retrying_one_create_key_make_one_instance(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """32 threads create under one request_id at once: one instance, 32 equal answers; the key
    with other data raises CreateKeyReused."""
    engine = sync_engine(pg_url, pg_schema)
    try:

        def work(n: int, barrier: threading.Barrier) -> list[Any]:
            barrier.wait()
            make = partial(engine.create, "approval", instance_id="r", data={"a": 1})
            return [attempt(partial(make, request_id="K"))]

        answers = in_threads(work)
        assert all(a == answers[0] for a in answers), answers
        assert answers[0].version == 1 and engine.count() == 1
        with pytest.raises(flowlock.CreateKeyReused):
            engine.create("approval", instance_id="r", data={"a": 2}, request_id="K")
        verify(engine, sql_history, {"r": 0})
    finally:
        engine.close()


def test_threads_share_one_engine_inventory(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """32 threads x 4 reservations on a stock of 50, pessimistic: exactly 50 applied, 78 refused
    as out of stock (GuardRejected), the stock never below 0, each request id once."""
    calls = 4
    with sync_engine(pg_url, pg_schema) as engine:
        engine.create("inventory", instance_id="sku", data={"stock": 50, "reserved": 0})

        def buyer(n: int, barrier: threading.Barrier) -> list[Any]:
            barrier.wait()
            return [
                attempt(
                    partial(
                        engine.fire,
                        "sku",
                        "reserve",
                        actor=f"buyer-{n}",
                        request_id=f"order-{n}-{i}",
                        strategy="pessimistic",
                    )
                )
                for i in range(calls)
            ]

        outs = in_threads(buyer)
        applied = [o for o in outs if isinstance(o, flowlock.Outcome) and o.applied]
        refused = [o for o in outs if isinstance(o, flowlock.GuardRejected)]
        assert len(applied) == 50 and len(refused) == THREADS * calls - 50, outs[:3]
        assert all("out of stock" in e.reason for e in refused)
        final = engine.get("sku")
        assert final.data == {"stock": 0, "reserved": 50}
        verify(
            engine,
            sql_history,
            {"sku": 50},
            initial_state="open",
            invariant=no_oversell,
            invariant_kind=OVERSELL,
        )


# -- a real WSGI server in its own process --------------------------------------------------


@contextmanager
def flask_app(pg_url: str, schema: str, log: Path) -> Iterator[tuple[str, list[str]]]:
    """tests/sync_flask_app.py served by werkzeug's threaded server in a process of its own:
    yields its base URL and, once it has stopped (SIGINT), what it printed after the port."""
    env = {**os.environ, "FLOWLOCK_TEST_DATABASE_URL": pg_url, "FLOWLOCK_SYNC_APP_SCHEMA": schema}
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(TESTS / "sync_flask_app.py")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert proc.stdout is not None
    printed: list[str] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("port "), (line, log.read_text())
        yield f"http://127.0.0.1:{int(line.split()[1])}", printed
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        printed.extend(rest.splitlines())
        printed.append(f"exit {proc.returncode}")


def post(url: str, body: Mapping[str, Any], key: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.slow
def test_flask_app_on_a_threaded_wsgi_server(
    pg_url: str, pg_schema: str, sql_history: SqlHistory, tmp_path: Path
) -> None:
    """A Flask app with one module-level sync engine, served by werkzeug's threaded server in its
    own process: 32 concurrent clients approve one request per round (one 200 applied, the rest
    200 idempotent) and reserve 3 units each of a stock of 40 (40 applied, 56 refused with 422,
    flowlock.http's guard-rejected problem), then retry every reservation with its
    Idempotency-Key (the first answer again, nothing applied twice). Never a 500; the checker
    and the SQL count agree; the process exits cleanly with its engine closed by the exit
    hook."""
    rounds, each = 3, 3
    with sync_engine(pg_url, pg_schema) as engine:
        for r in range(rounds):
            engine.create("approval", instance_id=f"req-{r}")
        engine.create("inventory", instance_id="sku", data={"stock": 40, "reserved": 0})

        with flask_app(pg_url, pg_schema, tmp_path / "app.log") as (base, printed):

            def client(n: int, barrier: threading.Barrier) -> list[Any]:
                answers: list[Any] = []
                for r in range(rounds):
                    barrier.wait()
                    url = f"{base}/instances/req-{r}/events/approve"
                    answers.append(("approve", *post(url, {"actor": f"admin-{n}"})))
                barrier.wait()
                for again in (False, True):
                    for i in range(each):
                        code, body = post(
                            f"{base}/instances/sku/events/reserve",
                            {"actor": f"buyer-{n}", "strategy": "pessimistic"},
                            key=f"order-{n}-{i}",
                        )
                        answers.append(("retry" if again else "reserve", code, body))
                    barrier.wait()  # every first try is answered before the retries start
                return answers

            answers = in_threads(client)

        assert printed[-2:] == ["engine closed at exit: True", "exit 0"], printed
        assert {code for _, code, _ in answers} <= {200, 422}, [a for a in answers if a[1] >= 500]
        approvals = [body for kind, _, body in answers if kind == "approve"]
        assert sum(b["applied"] for b in approvals) == rounds
        assert sum(b["idempotent"] for b in approvals) == rounds * (THREADS - 1)
        first = [(code, body) for kind, code, body in answers if kind == "reserve"]
        retries = [(code, body) for kind, code, body in answers if kind == "retry"]
        assert sum(code == 200 and body["applied"] for code, body in first) == 40
        refused = "urn:flowlock:problem:guard-rejected"
        assert sum(code == 422 and body["type"] == refused for code, body in first) == 56
        assert not any(code == 200 and body["applied"] for code, body in retries)
        assert sum(code == 200 and body["idempotent"] for code, body in retries) == 40
        assert engine.get("sku").data == {"stock": 0, "reserved": 40}
        verify(engine, sql_history, {f"req-{r}": 1 for r in range(rounds)}, initial_state="pending")
        verify(engine, sql_history, {"sku": 40}, invariant=no_oversell, invariant_kind=OVERSELL)


# -- the same errors, closing, event loops ---------------------------------------------------

# Each a call that fails, as (method, args, kwargs); run on both engines over the same rows.
FAILING: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("create", ("payroll",), {"instance_id": "x"}),
    ("create", ("approval",), {"instance_id": ""}),
    ("create", ("approval",), {"instance_id": "dup"}),
    ("create", ("approval",), {"instance_id": "y", "data": [1]}),
    ("get", ("missing",), {}),
    ("history", ("bad\x00id",), {}),
    ("fire", ("missing", "approve"), {}),
    ("fire", ("done", "reject"), {}),
    ("fire", ("empty", "reserve"), {}),
    ("fire", ("pend", "approve"), {"expected_version": 5}),
    ("fire", ("pend", "explode"), {}),
    ("fire", ("pend", "approve"), {"payload": {"big": "x" * 70_000}}),
    ("fire", ("pend", "approve"), {"strategy": "distributed"}),
    ("register", ("approval",), {}),
]


def test_errors_are_the_async_engines_very_classes(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """Every failing call raises the very exception class the async engine raises for it, with
    the same message and facts (state, allowed events, versions), and writes nothing."""
    with sync_engine(pg_url, pg_schema) as engine:
        for iid in ("dup", "done", "pend"):
            engine.create("approval", instance_id=iid)
        engine.fire("done", "approve")
        engine.create("inventory", instance_id="empty", data={"stock": 0})
        before = counted(sql_history)

        mine = [attempt(partial(getattr(engine, m), *a, **kw)) for m, a, kw in FAILING]

        async def theirs() -> list[Any]:
            store = PostgresStore(pg_url, schema=pg_schema)
            async with flowlock.Engine(store) as aengine:
                await aengine.register(flowlock.examples.approval())
                await aengine.register(flowlock.examples.inventory())
                found = []
                for m, a, kw in FAILING:
                    try:
                        found.append(await getattr(aengine, m)(*a, **kw))
                    except flowlock.FlowlockError as exc:
                        found.append(exc)
                return found

        expected = asyncio.run(theirs())
        assert [type(e) for e in mine] == [type(e) for e in expected]
        assert all(isinstance(e, flowlock.FlowlockError) for e in mine), mine
        assert [str(e) for e in mine] == [str(e) for e in expected]
        kinds = {type(e) for e in mine}
        assert {
            flowlock.UnknownWorkflow, flowlock.InvalidInput, flowlock.InstanceExists,
            flowlock.InstanceNotFound, flowlock.TransitionNotAllowed, flowlock.GuardRejected,
            flowlock.VersionMismatch, flowlock.UnknownEvent, flowlock.PayloadTooLarge,
        } <= kinds  # fmt: skip
        refused = mine[FAILING.index(("fire", ("done", "reject"), {}))]
        assert isinstance(refused, flowlock.TransitionNotAllowed)
        assert (refused.state, refused.allowed, refused.version) == ("approved", (), 2)
        after = counted(sql_history)
        assert (after.rows, after.versions) == (before.rows, before.versions)


def flowlock_threads() -> int:
    return sum(t.name == "flowlock-sync" for t in threading.enumerate())


def test_close_is_idempotent_joins_the_thread_and_later_calls_raise_engine_closed(
    pg_url: str, pg_schema: str
) -> None:
    """No thread until the first call; close() twice; the thread is joined; every call after
    close (open included) raises EngineClosed, as does `with` on a closed engine."""
    threads = flowlock_threads()
    engine = flowlock.sync.Engine.connect(pg_url, schema=pg_schema)
    assert flowlock_threads() == threads and not engine.closed
    with engine:
        engine.register(flowlock.examples.approval())
        engine.create("approval", instance_id="a")
        assert flowlock_threads() == threads + 1
    assert engine.closed and flowlock_threads() == threads
    engine.close()
    calls: list[Callable[[], object]] = [
        lambda: engine.get("a"),
        lambda: engine.fire("a", "approve"),
        lambda: engine.create("approval", instance_id="b"),
        lambda: engine.history("a"),
        lambda: engine.register(flowlock.examples.approval()),
        engine.open,
        engine.__enter__,
    ]
    for call in calls:
        with pytest.raises(flowlock.EngineClosed):
            call()
    assert flowlock_threads() == threads


def test_the_exit_hook_closes_every_engine_left_running(pg_url: str, pg_schema: str) -> None:
    """The hook run at exit closes an opened engine and one that only registered, and joins
    their threads (test_an_engine_left_open_is_closed_at_exit shows it runs at exit)."""
    threads = flowlock_threads()
    opened = sync_engine(pg_url, pg_schema).open()
    registered = sync_engine(pg_url, pg_schema)
    assert flowlock_threads() == threads + 2
    flowlock.sync._close_all()
    assert opened.closed and registered.closed and flowlock_threads() == threads
    with pytest.raises(flowlock.EngineClosed):
        opened.get("a")


def test_the_first_call_opens_the_engine_once_for_every_thread(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """An engine never opened explicitly opens on the first call, once, however many threads
    make it at once."""
    engine = sync_engine(pg_url, pg_schema)
    try:

        def first(n: int, barrier: threading.Barrier) -> list[Any]:
            barrier.wait()
            return [engine.create("approval", instance_id=f"i-{n}")]

        made = in_threads(first)
        assert sorted(i.id for i in made) == sorted(f"i-{n}" for n in range(THREADS))
    finally:
        engine.close()
    rows = counted(sql_history)
    assert len(rows.versions) == THREADS


async def test_a_call_inside_a_running_event_loop_raises_instead_of_blocking(
    pg_url: str, pg_schema: str
) -> None:
    """Called from async code, each method raises SyncCallInEventLoop at once (nothing started,
    no thread); a guard calling the engine from the engine's own loop gets it too, instead of a
    deadlock, and the fire that ran the guard raises StepFailed caused by it."""
    threads = flowlock_threads()
    engine = flowlock.sync.Engine.connect(pg_url, schema=pg_schema)
    for call in (
        lambda: engine.get("a"),
        lambda: engine.fire("a", "approve"),
        lambda: engine.register(flowlock.examples.approval()),
        engine.open,
        engine.close,
    ):
        with pytest.raises(flowlock.SyncCallInEventLoop, match=r"use flowlock\.Engine"):
            call()
    assert flowlock_threads() == threads and not engine.closed
    assert issubclass(flowlock.SyncCallInEventLoop, flowlock.FlowlockError)

    def reentrant(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        engine.get(inst.id)  # runs on the engine's own loop thread
        return True

    looping = flowlock.Workflow(
        "loop",
        states=["a", "b"],
        initial="a",
        transitions=[flowlock.Transition("go", source="a", target="b", guard=reentrant)],
    )

    def from_a_thread() -> None:
        with engine:
            engine.register(looping)
            engine.create("loop", instance_id="l")
            # A guard's own error is reported as StepFailed, the engine's refusal its cause.
            with pytest.raises(flowlock.StepFailed, match=r"Engine\.get\(\)") as failed:
                engine.fire("l", "go")
            assert isinstance(failed.value.__cause__, flowlock.SyncCallInEventLoop)
            assert engine.get("l").version == 1

    await asyncio.to_thread(from_a_thread)
    assert engine.closed


def test_signatures_match_the_async_engine() -> None:
    """Every public method of the async engine has a blocking twin with the same parameters
    (open/aclose -> open/close), and the same read-only properties."""

    def params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any, Any]]:
        sig = inspect.signature(fn)
        return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]

    for name, member in inspect.getmembers(flowlock.Engine):
        if name.startswith("_") or name in ("open", "aclose", "connect"):
            continue
        if inspect.iscoroutinefunction(member):
            twin = getattr(SyncEngine, name, None)
            assert twin is not None, f"flowlock.sync.Engine has no {name}()"
            assert not inspect.iscoroutinefunction(twin)

            # connection= takes another kind of connection (a blocking psycopg or Django one, not
            # an asyncpg one, which belongs to the caller's event loop): its type differs.
            def untyped_connection(found: list[tuple[str, Any, Any, Any]]) -> list[Any]:
                return [p[:3] if p[0] == "connection" else p for p in found]

            theirs = untyped_connection(params(member))
            assert untyped_connection(params(twin)) == theirs, name
    for prop in ("workflows", "strategies", "monitor", "metrics", "closed"):
        assert isinstance(inspect.getattr_static(SyncEngine, prop), property), prop
    assert isinstance(flowlock.sync.Engine.connect("memory://"), SyncEngine)


async def test_connect_refuses_an_application_pool(pg_url: str) -> None:
    """pool= is in connect's signature (it is the async engine's) but refused: an asyncpg pool
    belongs to the loop that created it, not to the sync engine's own."""
    pool = await pg_budget.create_pool(pg_url, min_size=0, max_size=1)
    try:
        with pytest.raises(InvalidInput, match="event loop"):
            flowlock.sync.Engine.connect(pool=pool)
    finally:
        await pool.close()


def test_constructor_takes_a_store_or_an_unopened_async_engine(pg_url: str, pg_schema: str) -> None:
    """Engine(store, ...) as flowlock.Engine(store, ...); Engine(async_engine) wraps one not yet
    open; an open one, or one given with options, is refused with InvalidInput."""
    store = PostgresStore(pg_url, schema=pg_schema)
    with flowlock.sync.Engine(store, strategy="pessimistic") as engine:
        engine.register(flowlock.examples.approval())
        engine.create("approval", instance_id="a")
        assert engine.fire("a", "approve").strategy == "pessimistic"
        assert list(engine.workflows) == ["approval"]
        assert {"optimistic", "pessimistic", "adaptive"} <= set(engine.strategies)
        assert engine.monitor.escalate_to == "pessimistic" and engine.metrics is None
    wrapped = flowlock.Engine(PostgresStore(pg_url, schema=pg_schema))
    with flowlock.sync.Engine(wrapped) as engine:
        engine.register(flowlock.examples.approval())
        assert engine.get("a").state == "approved"
    assert wrapped.closed
    with pytest.raises(flowlock.InvalidInput, match="options"):
        flowlock.sync.Engine(flowlock.Engine(store), strategy="pessimistic")

    async def opened() -> None:
        async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema)) as live:
            with pytest.raises(flowlock.InvalidInput, match="not open yet"):
                flowlock.sync.Engine(live)

    asyncio.run(opened())
    with pytest.raises(flowlock.InvalidInput, match="unknown default strategy"):
        flowlock.sync.Engine(store, strategy="nope")


# -- interrupts --------------------------------------------------------------------------------


class GatedStore(PostgresStore):
    """Holds every commit until the test opens the gate, and says when one is waiting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = threading.Event()
        self.gate = threading.Event()

    async def commit(self, entries: Sequence[HistoryEntry]) -> flowlock.Instance | None:
        self.waiting.set()
        await asyncio.to_thread(self.gate.wait, 60)
        return await super().commit(entries)


class Seen(logging.Handler):
    """Sets ``event`` when the flowlock logger says it is waiting for an interrupted call."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "while a call is running" in record.getMessage():
            self.event.set()


@contextmanager
def interrupter(store: GatedStore, then: Callable[[Seen], None]) -> Iterator[None]:
    """Sends SIGINT to this (the main) thread once a commit is waiting at the gate, then, once
    the engine has logged that it waits for the call, runs ``then``."""
    seen = Seen()
    logger = logging.getLogger("flowlock")
    logger.addHandler(seen)
    main = threading.main_thread().ident
    assert main == threading.get_ident()

    def run() -> None:
        if store.waiting.wait(60):
            signal.pthread_kill(main, signal.SIGINT)
            if seen.event.wait(60):
                then(seen)

    helper = threading.Thread(target=run)
    helper.start()
    try:
        yield
    finally:
        store.gate.set()
        helper.join(60)
        logger.removeHandler(seen)


def test_an_interrupt_waits_for_the_running_call_then_says_what_it_did(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """A KeyboardInterrupt while fire() waits does not cut the call short: the call commits, and
    then the interrupt is raised with a note saying it applied; one history row."""
    store = GatedStore(pg_url, schema=pg_schema)
    with flowlock.sync.Engine(store) as engine:
        engine.register(flowlock.examples.approval())
        engine.create("approval", instance_id="a")
        with (
            interrupter(store, then=lambda _: store.gate.set()),
            pytest.raises(KeyboardInterrupt) as info,
        ):
            engine.fire("a", "approve", request_id="r-1")
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "ran to its end first: 'approve' applied" in notes and "version 2" in notes
        assert engine.fire("a", "approve", request_id="r-1").idempotent
        verify(engine, sql_history, {"a": 1}, initial_state="pending")


def test_a_second_interrupt_stops_waiting_and_close_waits_for_the_call(
    pg_url: str, pg_schema: str, sql_history: SqlHistory
) -> None:
    """A second interrupt stops the waiting; the call still runs to its end on the engine's
    thread (close() waits for it) and is recorded once."""
    store = GatedStore(pg_url, schema=pg_schema)
    engine = flowlock.sync.Engine(store)
    try:
        engine.register(flowlock.examples.approval())
        engine.create("approval", instance_id="a")
        main = threading.get_ident()
        with (
            interrupter(store, then=lambda _: signal.pthread_kill(main, signal.SIGINT)),
            pytest.raises(KeyboardInterrupt) as info,
        ):
            engine.fire("a", "approve")
        assert "still running" in " ".join(getattr(info.value, "__notes__", []))
    finally:
        engine.close()  # the gate is open now: the call finishes and close() waits for it
    rows = counted(sql_history)
    assert rows.rows == {"a": 1} and rows.versions == {"a": 2}


# -- process exit and forks ----------------------------------------------------------------------

EXIT_SCRIPT = """
import atexit, sys, threading
atexit.register(lambda: print("at exit:", engine.closed, [t.name for t in threading.enumerate()]))
import flowlock
engine = flowlock.sync.Engine.connect(sys.argv[1], schema=sys.argv[2])
engine.register(flowlock.examples.approval())
engine.create("approval", instance_id="left-open")
print(engine.fire("left-open", "approve").applied)
"""


def test_an_engine_left_open_is_closed_at_exit(pg_url: str, pg_schema: str) -> None:
    """A script that never closes its engine exits cleanly: the exit hook closed the engine and
    its thread is gone by the time the script's own atexit hooks run."""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", EXIT_SCRIPT, pg_url, pg_schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True", "at exit: True ['MainThread']"], done.stdout
    assert not done.stderr, done.stderr


FORK_SCRIPT = """
import json, os, sys
import flowlock
url, schema = sys.argv[1], sys.argv[2]
lazy = flowlock.sync.Engine.connect(url, schema=schema)
lazy.register(flowlock.examples.approval())      # starts the thread, connects nothing
opened = flowlock.sync.Engine.connect(url, schema=schema).open()
opened.register(flowlock.examples.approval())
opened.create("approval", instance_id="parent-1")
pid = os.fork()
if pid == 0:
    seen = {"lazy": lazy.create("approval", instance_id="child-1").version}
    try:
        opened.get("parent-1")
    except flowlock.EngineClosed as exc:
        seen["opened"] = str(exc)
    print(json.dumps(seen), flush=True)
    sys.exit(0)                                   # the exit hooks run: parent's untouched
_, status = os.waitpid(pid, 0)
print(json.dumps({"child": os.waitstatus_to_exitcode(status),
                  "parent": opened.fire("parent-1", "approve").applied,
                  "lazy": lazy.get("child-1").version}), flush=True)
"""


def test_after_a_fork_each_process_uses_its_own_connections(pg_url: str, pg_schema: str) -> None:
    """A pre-fork server: an engine that only registered before the fork works in the child
    (its own thread and connections); one opened before the fork raises EngineClosed in the
    child, saying why, and still works in the parent after the child has exited."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, pg_url, pg_schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    child, parent = (json.loads(line) for line in done.stdout.splitlines())
    assert child["lazy"] == 1
    assert "opened its connections in process" in child["opened"]
    assert parent == {"child": 0, "parent": True, "lazy": 1}


def test_no_thread_on_import() -> None:
    """Importing flowlock (and flowlock.sync) starts no thread."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import threading, flowlock; flowlock.sync.Engine; print(threading.active_count())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "1", done.stderr


def test_list_and_count_page_the_pending_approvals(pg_url: str, pg_schema: str) -> None:
    """The blocking twins of Engine.list and Engine.count: the same filters, pages and cursor."""
    with sync_engine(pg_url, pg_schema) as engine:
        for n in range(5):
            engine.create("approval", instance_id=f"req-{n}")
        engine.fire("req-2", "approve")
        assert engine.count(workflow="approval", state="pending") == 4
        first = engine.list(workflow="approval", state="pending", limit=3)
        assert [i.id for i in first] == ["req-0", "req-1", "req-3"]
        assert first.next_cursor is not None
        rest = engine.list(workflow="approval", state="pending", limit=3, after=first.next_cursor)
        assert [i.id for i in rest] == ["req-4"] and rest.next_cursor is None
        with pytest.raises(flowlock.InvalidInput):
            engine.list(limit=0)
