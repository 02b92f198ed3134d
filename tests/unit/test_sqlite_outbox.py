"""The transactional outbox on the SQLite store: messages written in the transaction of the
commit's compare-and-swap (and only when it won), claimed in per-instance order by one claimer
at a time (also across store objects on one file), failed, retried, dropped and purged."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import flowlock
from flowlock.core import migrations
from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Instance, Snapshot
from flowlock.core.outbox import Emit, Message
from flowlock.locks import MemoryLocks
from flowlock.stores.base import OutboxStore, RowLock
from flowlock.stores.sqlite import SqliteStore

OUTBOX = "007_outbox"
LONG = 60.0  # a lease nobody outlives in a test


def new(instance_id: str = "i") -> Instance:
    return Instance(id=instance_id, workflow="order", state="open", version=0, data={})


def entry(
    instance_id: str,
    version: int,
    *emits: Emit,
    request_id: str | None = None,
    fencing_token: int | None = None,
    trace: str | None = None,
) -> HistoryEntry:
    return HistoryEntry(
        instance_id=instance_id,
        version=version,
        event="touch",
        from_state="open",
        to_state="open",
        actor=None,
        request_id=request_id,
        strategy="optimistic",
        data={"v": version},
        fencing_token=fencing_token,
        emits=emits,
        trace=trace,
    )


def emit(kind: str = "notify", **payload: Any) -> Emit:
    return Emit(kind, payload)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "outbox.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteStore]:
    async with SqliteStore(db_path) as s:
        yield s


async def emitted(store: SqliteStore, instance_id: str, *per_version: Sequence[Emit]) -> None:
    """Create `instance_id` and commit one entry per item of `per_version` (versions 2, 3...),
    each emitting its messages."""
    await store.create(new(instance_id))
    for offset, emits in enumerate(per_version):
        assert await store.commit([entry(instance_id, 2 + offset, *emits)]) is not None


def keys(messages: Sequence[Message]) -> list[str]:
    return [m.key for m in messages]


def raw(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(path)
    try:
        rows = db.execute(sql, args).fetchall()
        db.commit()
        return rows
    finally:
        db.close()


def test_the_sqlite_store_is_an_outbox_store() -> None:
    """SqliteStore implements the OutboxStore port."""
    assert isinstance(SqliteStore(":memory:"), OutboxStore)


def test_outbox_poll_is_checked() -> None:
    """outbox_poll is a positive number of seconds; anything else is refused."""
    with pytest.raises(InvalidInput, match="outbox_poll"):
        SqliteStore(":memory:", outbox_poll=0)
    assert SqliteStore.from_url("sqlite:///:memory:", outbox_poll=0.5).outbox_poll == 0.5


# -- the schema -------------------------------------------------------------------------------


async def test_the_migration_makes_the_table_and_its_indexes(store: SqliteStore) -> None:
    """007_outbox makes flowlock_outbox, keyed (instance_id, version, n), key unique, status
    checked, with the due (claim), order, claimed and retention indexes."""
    assert OUTBOX in [m.name for m in migrations.load("sqlite")]
    indexes = {
        row[0]
        for row in raw(
            Path(store.path),
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'flowlock_outbox'"
            " AND name NOT LIKE 'sqlite_autoindex%'",
        )
    }
    assert indexes == {
        "flowlock_outbox_due",
        "flowlock_outbox_order",
        "flowlock_outbox_claimed",
        "flowlock_outbox_done",
    }
    await emitted(store, "i", [emit()])
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        raw(Path(store.path), "UPDATE flowlock_outbox SET status = 'running'")
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        raw(
            Path(store.path),
            "INSERT INTO flowlock_outbox (instance_id, version, n, key, workflow, kind, payload,"
            " due_at, created_at) VALUES ('i', 9, 0, 'i:2:0', 'order', 'k', '{}', 0, 0)",
        )


async def test_a_database_made_before_the_outbox_migrates(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file migrated up to 006 takes 007 on open; its instances then emit messages."""
    before = [m for m in migrations.load("sqlite") if m.name < OUTBOX]
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load", lambda dialect: before)
        async with SqliteStore(db_path):
            pass
    # Written as the code of that time wrote it: today's store reads columns added since.
    db = sqlite3.connect(db_path)
    try:
        db.execute(
            "INSERT INTO flowlock_instances (id, workflow, state, version, data, last_event,"
            " created_at, updated_at, stay_version) VALUES ('old', 'order', 'open', 2, '{}',"
            " 'touch', '2024-01-01T00:00:00+00:00', '2024-01-01T00:00:00+00:00', 1)"
        )
        db.commit()
    finally:
        db.close()
    async with SqliteStore(db_path) as s:
        assert await s.commit([entry("old", 3, emit(to="a"))]) is not None
        assert keys(await s.messages("old")) == ["old:3:0"]


# -- what commits write -----------------------------------------------------------------------


async def test_a_commit_writes_its_emits_as_pending_messages(store: SqliteStore) -> None:
    """Each entry's emits become pending rows keyed <id>:<version>:<n>, due now, attempts 0,
    with the workflow, kind, payload, fencing token and trace of their entry."""
    await store.create(new())
    before = datetime.now(UTC) - timedelta(seconds=1)
    committed = await store.commit(
        [
            entry("i", 2, emit(to="a"), emit("charge", cents=5), fencing_token=7, trace="tp-1"),
            entry("i", 3),
            entry("i", 4, emit(to="b"), fencing_token=7),
        ]
    )
    assert committed is not None and committed.version == 4
    first, second, third = await store.messages("i")
    assert keys([first, second, third]) == ["i:2:0", "i:2:1", "i:4:0"]
    assert (first.version, first.n, second.n, third.version) == (2, 0, 1, 4)
    assert (first.kind, first.payload, second.kind, second.payload) == (
        "notify",
        {"to": "a"},
        "charge",
        {"cents": 5},
    )
    assert {m.workflow for m in (first, second, third)} == {"order"}
    assert (first.fencing_token, first.trace, third.trace) == (7, "tp-1", None)
    for m in (first, second, third):
        assert (m.status, m.attempts, m.last_error, m.done_at, m.claimed_until) == (
            "pending",
            0,
            None,
            None,
            None,
        )
        assert m.created_at is not None and m.next_attempt_at == m.created_at
        assert before < m.created_at <= datetime.now(UTC)
    assert await store.next_message_due(["notify", "charge"]) == 0.0


async def test_a_lost_compare_and_swap_writes_no_message(store: SqliteStore) -> None:
    """A stale version, a request id already applied, or a lower fencing token: the commit
    answers None and writes no message."""
    await store.create(new())
    assert await store.commit([entry("i", 2, emit(), request_id="r", fencing_token=5)])
    assert await store.commit([entry("i", 2, emit(n=1))]) is None  # stale version
    assert await store.commit([entry("i", 3, emit(n=2), request_id="r")]) is None  # applied
    assert await store.commit([entry("i", 3, emit(n=3), fencing_token=4)]) is None  # fenced
    assert keys(await store.messages("i")) == ["i:2:0"]


async def test_commit_many_writes_the_messages_of_the_winners_only(store: SqliteStore) -> None:
    """commit_many: each batch that wins writes its messages, one that loses writes none."""
    for iid in ("a", "b", "c"):
        await store.create(new(iid))
    assert await store.commit([entry("b", 2)])
    answers = await store.commit_many(
        [
            [entry("a", 2, emit(x=1)), entry("a", 3, emit(x=2), emit(x=3))],
            [entry("b", 2, emit(x=4))],  # b is at 2 already: loses
            [entry("c", 2, emit("other"))],
        ]
    )
    assert [a is not None for a in answers] == [True, False, True]
    assert keys(await store.find_messages()) == ["a:2:0", "a:3:0", "a:3:1", "c:2:0"]
    assert await store.messages("b") == []


async def test_apply_locked_writes_what_the_plan_emits(store: SqliteStore) -> None:
    """apply_locked writes the planned entries' messages; a plan that asks for no write, or
    raises, writes none."""
    await store.create(new())

    def plan(snapshot: Snapshot) -> list[HistoryEntry]:
        return [entry("i", snapshot.instance.version + 1, emit(locked=True))]

    result = await store.apply_locked("i", [], plan, RowLock())
    assert result.committed is not None
    assert await store.apply_locked("i", [], lambda s: None, RowLock())

    def failing(snapshot: Snapshot) -> list[HistoryEntry]:
        raise InvalidInput("no")

    with pytest.raises(InvalidInput):
        await store.apply_locked("i", [], failing, RowLock())
    [only] = await store.messages("i")
    assert (only.key, only.payload) == ("i:2:0", {"locked": True})


async def test_a_payload_that_cannot_be_stored_writes_nothing(store: SqliteStore) -> None:
    """An emit payload that is not JSON is refused (InvalidInput) before the transaction:
    neither the transition nor a message is written."""
    await store.create(new())
    with pytest.raises(InvalidInput, match="payload of message 'i:2:0'"):
        await store.commit([entry("i", 2, Emit("notify", {"bad": {1, 2}}))])
    assert (await store.get("i")).version == 1
    assert await store.messages("i") == []


async def test_a_commit_without_emits_runs_no_outbox_statement(store: SqliteStore) -> None:
    """Commits, creates and locked applies that emit nothing never touch flowlock_outbox
    (SQLite's trace callback sees every statement each connection runs)."""
    pool = store._pool
    assert pool is not None
    seen: list[str] = []
    for worker in pool.workers:
        set_trace = worker.conn.set_trace_callback
        await asyncio.wrap_future(worker.executor.submit(set_trace, seen.append))
    await store.create(new())
    assert await store.commit([entry("i", 2)])
    assert await store.commit_many([[entry("i", 3), entry("i", 4)]])
    plan = lambda s: [entry("i", s.instance.version + 1)]  # noqa: E731
    assert (await store.apply_locked("i", [], plan, RowLock())).committed
    assert any("flowlock_history" in s for s in seen)
    assert not [s for s in seen if "flowlock_outbox" in s]
    assert await store.commit([entry("i", 6, emit())])
    assert [s for s in seen if "flowlock_outbox" in s]


# -- through the engine -------------------------------------------------------------------------


def _order_workflow() -> flowlock.Workflow:
    def reserve(inst: Instance, payload: Any, actor: str | None) -> flowlock.Step:
        return flowlock.Step({"sku": payload["sku"]}, emit=[Emit("reserve", dict(payload))])

    return flowlock.Workflow(
        "order",
        states=["open", "reserved", "shipped"],
        initial="open",
        transitions=[
            flowlock.Transition("reserve", source="open", target="reserved", effect=reserve),
            flowlock.Transition(
                "ship",
                source="reserved",
                target="shipped",
                emit=lambda inst, payload, actor: [
                    Emit("notify", {"to": actor, "sku": inst.data["sku"]}),
                    Emit("ship", {"sku": inst.data["sku"]}),
                ],
            ),
        ],
    )


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic", "distributed"])
@pytest.mark.parametrize("batching", [True, False])
async def test_the_engine_writes_what_transitions_emit(
    db_path: Path, strategy: str, batching: bool
) -> None:
    """Through the engine, on every strategy, batching on and off: Step(emit=) and
    Transition(emit=) write their messages once; an idempotent answer or a refusal emits
    nothing; under a lease, the messages carry its fencing token."""
    store = SqliteStore(db_path)
    async with flowlock.Engine(
        store, locks=MemoryLocks(), strategy=strategy, batching=batching, timers=False
    ) as engine:
        await engine.register(_order_workflow())
        ids = [f"o{i}" for i in range(4)]
        for iid in ids:
            await engine.create("order", instance_id=iid)
        outs = await asyncio.gather(
            *(engine.fire(i, "reserve", payload={"sku": i}, request_id="r1") for i in ids),
            *(engine.fire(i, "reserve", payload={"sku": i}, request_id="r1") for i in ids),
        )
        assert sum(o.applied for o in outs) == len(ids)
        for iid in ids:
            await engine.fire(iid, "ship", actor="ann")
        with pytest.raises(flowlock.TransitionNotAllowed):
            await engine.fire("o0", "reserve", payload={"sku": "x"})
        for iid in ids:
            messages = await engine.messages(iid)
            assert [(m.key, m.kind) for m in messages] == [
                (f"{iid}:2:0", "reserve"),
                (f"{iid}:3:0", "notify"),
                (f"{iid}:3:1", "ship"),
            ]
            assert messages[1].payload == {"to": "ann", "sku": iid}
            fenced = [m.fencing_token is not None for m in messages]
            assert fenced == [strategy == "distributed"] * 3
        assert (await engine.message("o1:3:1")).payload == {"sku": "o1"}
        assert len(await engine.find_messages(kind="notify")) == len(ids)


# -- claiming ---------------------------------------------------------------------------------


async def test_claim_takes_each_kind_up_to_its_limit_oldest_first(store: SqliteStore) -> None:
    """A claim takes at most each kind's limit, oldest due (here: committed) first, counts up
    the attempt, holds the messages for `lease` (running), and answers the lag since the
    commit."""
    for iid in ("c", "a", "b"):  # committed in this order: c is the oldest
        await emitted(store, iid, [emit(), emit("charge")])
    await store.create(new("d"))
    assert await store.commit([entry("d", 2, emit("charge"))])
    got = await store.claim_messages({"notify": 2, "charge": 5, "none": 3}, lease=LONG, owner="w")
    # Each instance's charge waits behind its notify (same version, lower n): only d's goes.
    assert keys(got) == ["c:2:0", "a:2:0", "d:2:0"]
    before = datetime.now(UTC)
    for m in got:
        assert (m.status, m.attempts, m.attempt) == ("running", 1, 1)
        assert m.claimed_until is not None and m.claimed_until > before + timedelta(seconds=50)
        assert m.lag >= 0.0
    assert [m.status for m in await store.messages("c")] == ["running", "pending"]
    [b] = await store.claim_messages({"notify": 5}, lease=LONG, owner="x")
    assert b.key == "b:2:0"  # the only notify left unheld
    assert await store.claim_messages({"notify": 5, "charge": 5}, lease=LONG, owner="y") == []
    assert await store.claim_messages({}, lease=LONG, owner="w") == []
    assert await store.claim_messages({"notify": 0}, lease=LONG, owner="w") == []


async def test_claim_goes_by_due_time(store: SqliteStore) -> None:
    """Oldest due first (as on PostgreSQL): a message due again after a failure takes its turn
    by its new due time, behind one committed later but due sooner."""
    await emitted(store, "x", [emit()])
    [x] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.fail_message(x, "w", "HTTP 503", retry_in=LONG)
    await emitted(store, "y", [emit()])
    now = time.time()
    path = Path(store.path)
    raw(path, "UPDATE flowlock_outbox SET due_at = ? WHERE key = 'x:2:0'", now - 5)
    raw(path, "UPDATE flowlock_outbox SET due_at = ? WHERE key = 'y:2:0'", now - 10)
    assert keys(await store.claim_messages({"notify": 1}, lease=LONG, owner="w")) == ["y:2:0"]
    assert keys(await store.claim_messages({"notify": 1}, lease=LONG, owner="w")) == ["x:2:0"]


async def test_a_claim_that_runs_out_is_taken_over(store: SqliteStore) -> None:
    """A claim whose lease ran out (its claimer died) is claimed again, attempts 2; the first
    claimer can then no longer fail or release it."""
    await emitted(store, "i", [emit()])
    [first] = await store.claim_messages({"notify": 1}, lease=0.05, owner="dead")
    assert await store.claim_messages({"notify": 1}, lease=LONG, owner="live") == []
    await asyncio.sleep(0.1)
    assert (await store.get_message("i:2:0")) == Message(
        **{**_fields(first), "status": "pending", "claimed_until": None}
    )
    [again] = await store.claim_messages({"notify": 1}, lease=LONG, owner="live")
    assert (again.key, again.attempts) == ("i:2:0", 2)
    assert not await store.fail_message(first, "dead", "late", retry_in=1.0)
    await store.release_message(first, "dead")
    assert (await store.get_message("i:2:0")).status == "running"  # type: ignore[union-attr]


def _fields(m: Message) -> dict[str, Any]:
    return {f: getattr(m, f) for f in Message.__dataclass_fields__ if f != "lag"}


async def test_messages_of_an_instance_go_in_order(store: SqliteStore) -> None:
    """A message is claimable only while no earlier message of its instance is pending (held
    or not, due or not, any kind); done and dead ones do not hold it back."""
    await emitted(store, "i", [emit(), emit("charge")], [emit()], [emit()])
    await emitted(store, "j", [emit("charge")])
    got = await store.claim_messages({"notify": 9, "charge": 9}, lease=LONG, owner="w")
    assert keys(got) == ["i:2:0", "j:2:0"]  # i:2:1 waits behind i:2:0, i:3:0 behind both
    assert await store.claim_messages({"charge": 9}, lease=LONG, owner="w") == []
    assert await store.finish_messages(["i:2:0"]) == 1
    [charge] = await store.claim_messages({"notify": 9, "charge": 9}, lease=LONG, owner="w")
    assert charge.key == "i:2:1"
    assert await store.fail_message(charge, "w", "boom", retry_in=LONG)
    # Failed and due later, it is still pending: i:3:0 keeps waiting.
    assert await store.claim_messages({"notify": 9, "charge": 9}, lease=LONG, owner="w") == []
    charge = await _retried(store, "i:2:1")
    assert await store.fail_message(charge, "w", "gave up", retry_in=None)
    [third] = await store.claim_messages({"notify": 9}, lease=LONG, owner="w")
    assert third.key == "i:3:0"
    assert await store.drop_message("i:3:0")
    [fourth] = await store.claim_messages({"notify": 9}, lease=LONG, owner="w")
    assert fourth.key == "i:4:0"


async def _retried(store: SqliteStore, key: str) -> Message:
    """Make `key` due now (a retry) and claim it."""
    assert await store.retry_message(key) is not None
    [claimed] = await store.claim_messages({"charge": 9}, lease=LONG, owner="w")
    assert claimed.key == key
    return claimed


async def test_fail_is_a_compare_and_swap_on_owner_and_attempt(store: SqliteStore) -> None:
    """fail_message with retry_in: pending again, due later, claim cleared, error kept; with
    None: dead. Another owner, another attempt, or a finished message: False, nothing changed."""
    await emitted(store, "i", [emit()])
    [m] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert not await store.fail_message(m, "other", "x", retry_in=1.0)
    stale = Message(**{**_fields(m), "attempts": 7})
    assert not await store.fail_message(stale, "w", "x", retry_in=1.0)
    assert await store.fail_message(m, "w", "HTTP 503", retry_in=30.0)
    failed = await store.get_message("i:2:0")
    assert failed is not None and (failed.status, failed.last_error) == ("pending", "HTTP 503")
    assert failed.claimed_until is None and failed.attempts == 1
    assert failed.next_attempt_at is not None
    assert failed.next_attempt_at > datetime.now(UTC) + timedelta(seconds=25)
    left = await store.next_message_due(["notify"])
    assert left is not None and 25 < left <= 30
    assert not await store.fail_message(m, "w", "again", retry_in=None)  # no longer held
    assert await store.claim_messages({"notify": 1}, lease=LONG, owner="w") == []  # not due
    assert await store.retry_message("i:2:0") is not None
    [m2] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.fail_message(m2, "w", "HTTP 410", retry_in=None)
    dead = await store.get_message("i:2:0")
    assert dead is not None and (dead.status, dead.next_attempt_at) == ("dead", None)
    assert await store.next_message_due(["notify"]) is None
    await emitted(store, "j", [emit()])
    [j] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.finish_messages([j.key]) == 1
    assert not await store.fail_message(j, "w", "late", retry_in=1.0)
    assert (await store.get_message(j.key)).status == "done"  # type: ignore[union-attr]


async def test_release_gives_the_claim_back(store: SqliteStore) -> None:
    """release_message frees `owner`'s claim at once (claimable again, attempts kept); a
    release by another owner changes nothing."""
    await emitted(store, "i", [emit()])
    [m] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    await store.release_message(m, "other")
    assert await store.claim_messages({"notify": 1}, lease=LONG, owner="x") == []
    await store.release_message(m, "w")
    [again] = await store.claim_messages({"notify": 1}, lease=LONG, owner="x")
    assert (again.key, again.attempts) == ("i:2:0", 2)


async def test_finish_marks_pending_messages_done_whoever_holds_them(store: SqliteStore) -> None:
    """finish_messages marks pending ones done (held or not, by anyone), counts each once, and
    leaves done, dead and unknown keys as they are."""
    await emitted(store, "i", [emit() for _ in range(3)])
    await emitted(store, "many", [emit() for _ in range(600)])  # more keys than one IN list
    [held] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.finish_messages([held.key, held.key, "i:2:1", "nope:1:0"]) == 2
    assert await store.finish_messages(["i:2:0", "i:2:1"]) == 0
    done = await store.get_message("i:2:0")
    assert done is not None and done.status == "done" and done.claimed_until is None
    assert done.done_at is not None and done.next_attempt_at is None
    assert await store.finish_messages([m.key for m in await store.messages("many")]) == 600
    assert await store.finish_messages([]) == 0


async def test_next_message_due(store: SqliteStore) -> None:
    """None when nothing of the kinds is pending; 0 when one is due; while every one is held,
    the time until the earliest claim runs out."""
    assert await store.next_message_due(["notify"]) is None
    assert await store.next_message_due([]) is None
    await emitted(store, "i", [emit()])
    assert await store.next_message_due(["charge"]) is None
    assert await store.next_message_due(["notify", "charge"]) == 0.0
    await store.claim_messages({"notify": 1}, lease=20.0, owner="w")
    left = await store.next_message_due(["notify"])
    assert left is not None and 15 < left <= 20
    many = [f"k{n}" for n in range(250)]  # more kinds than one statement asks about
    await emitted(store, "j", [emit("k249")])
    assert await store.next_message_due(many) == 0.0
    assert await store.next_message_due(many[:200]) is None


# -- reading and repairing ----------------------------------------------------------------------


async def test_find_messages_pages_in_key_order_with_filters(store: SqliteStore) -> None:
    """find_messages: message order (instance id in code points), a keyset after `after`,
    `limit`, and the status filter (running = pending and held; pending = not held) and kind
    filter."""
    for iid in ("b", "a", "Z", "é"):
        await emitted(store, iid, [emit(), emit("charge")])
    everything = keys(await store.find_messages())
    assert (
        everything
        == sorted(everything)
        == [
            "Z:2:0",
            "Z:2:1",
            "a:2:0",
            "a:2:1",
            "b:2:0",
            "b:2:1",
            "é:2:0",
            "é:2:1",
        ]
    )
    pages: list[str] = []
    after: str | None = None
    while page := await store.find_messages(limit=3, after=after):
        pages += keys(page)
        after = page[-1].key
    assert pages == everything
    await store.claim_messages({"notify": 2}, lease=LONG, owner="w")  # the oldest: b, a
    running = keys(await store.find_messages(status="running"))
    assert running == ["a:2:0", "b:2:0"]
    pending = keys(await store.find_messages(status="pending"))
    assert sorted(running + pending) == everything
    assert keys(await store.find_messages(kind="charge", after="a:2:1")) == ["b:2:1", "é:2:1"]
    assert await store.find_messages(status="done") == []
    assert await store.find_messages(status="nonsense") == []


async def test_get_retry_drop_and_count(store: SqliteStore) -> None:
    """get_message finds by key (None when missing); retry makes a dead message pending with
    attempts 0 (its error kept) and leaves a done or held one alone; drop deletes; count_messages
    has every status."""
    assert await store.get_message("i:2:0") is None
    assert await store.retry_message("i:2:0") is None
    assert not await store.drop_message("i:2:0")
    await emitted(store, "i", [emit()], [emit()], [emit()], [emit()])
    assert await store.count_messages() == {"pending": 4, "running": 0, "done": 0, "dead": 0}
    [m] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.fail_message(m, "w", "HTTP 400", retry_in=None)
    [m] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.finish_messages([m.key]) == 1
    await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
    assert await store.count_messages() == {"pending": 1, "running": 1, "done": 1, "dead": 1}
    retried = await store.retry_message("i:2:0")
    assert retried is not None
    assert (retried.status, retried.attempts, retried.last_error) == ("pending", 0, "HTTP 400")
    done = await store.retry_message("i:3:0")
    assert done is not None and done.status == "done"
    running = await store.retry_message("i:4:0")  # a held one is left to its delivery
    assert running is not None and (running.status, running.attempts) == ("running", 1)
    assert await store.drop_message("i:5:0")
    assert await store.get_message("i:5:0") is None
    assert await store.count_messages() == {"pending": 1, "running": 1, "done": 1, "dead": 0}


async def test_purge_deletes_old_done_messages_oldest_first(store: SqliteStore) -> None:
    """purge_messages deletes at most `limit` done messages done longer ago than `older_than`,
    oldest first; pending and dead ones, and recent done ones, stay."""
    await emitted(store, "i", *([emit()] for _ in range(5)))
    for key in ("i:2:0", "i:3:0", "i:4:0"):
        assert await store.finish_messages([key]) == 1
    path = Path(store.path)
    now = time.time()
    for age, key in ((300, "i:2:0"), (200, "i:3:0")):
        raw(path, "UPDATE flowlock_outbox SET done_at = ? WHERE key = ?", now - age, key)
    assert await store.purge_messages(100, 1) == 1
    assert await store.get_message("i:2:0") is None and await store.get_message("i:3:0")
    assert await store.purge_messages(100, 10) == 1
    assert keys(await store.messages("i")) == ["i:4:0", "i:5:0", "i:6:0"]
    assert await store.purge_messages(0, 10) == 1
    assert keys(await store.messages("i")) == ["i:5:0", "i:6:0"]


# -- waking dispatchers -------------------------------------------------------------------------


async def test_pending_is_set_by_writes_that_make_work(store: SqliteStore) -> None:
    """pending() is set by a commit that writes messages (not by one that writes none), by a
    retry, a drop and a failure that will be tried again."""
    await store.create(new())
    async with store.pending() as event:
        assert await store.commit([entry("i", 2)])
        assert not event.is_set()
        assert await store.commit([entry("i", 3, emit(), emit())])
        assert event.is_set()
        event.clear()
        [m] = await store.claim_messages({"notify": 1}, lease=LONG, owner="w")
        assert not event.is_set()
        assert await store.fail_message(m, "w", "x", retry_in=LONG)
        assert event.is_set()
        event.clear()
        assert await store.retry_message(m.key)
        assert event.is_set()
        event.clear()
        assert await store.drop_message(m.key)
        assert event.is_set()
    assert store._pending_events == set()


async def test_pending_polls_for_another_process_messages(db_path: Path) -> None:
    """Another store on the file cannot set this one's event: its poll (every outbox_poll
    seconds) does, and the claim then finds the other's message."""
    async with (
        SqliteStore(db_path, outbox_poll=0.2) as here,
        SqliteStore(db_path) as there,
        here.pending() as event,
    ):
        await emitted(there, "i", [emit()])
        event.clear()
        await asyncio.wait_for(event.wait(), 10)
        assert keys(await here.claim_messages({"notify": 1}, lease=LONG, owner="w")) == ["i:2:0"]


# -- two stores, one file -----------------------------------------------------------------------


async def test_two_stores_on_one_file_claim_each_message_once_in_order(db_path: Path) -> None:
    """Two stores (own connections and threads) on one file, two claimers each, claim while
    commits go on: every message is claimed exactly once, and each instance's messages are
    handled in key order (a message is claimed only after its predecessor was done)."""
    instances, versions = 20, 10
    limits = {"notify": 3, "charge": 2}
    by_store = {True: 0, False: 0}
    claims: list[str] = []
    handled: dict[str, list[tuple[int, int]]] = {}
    async with SqliteStore(db_path) as one, SqliteStore(db_path) as two:
        ids = [f"i{k}" for k in range(instances)]
        for iid in ids:
            await one.create(new(iid))
        total = instances * versions * 2

        async def produce(store: SqliteStore, mine: Sequence[str]) -> None:
            for version in range(2, versions + 2):
                for iid in mine:
                    kinds = ("notify", "charge") if version % 2 else ("charge", "notify")
                    emits = [emit(kinds[0], v=version), emit(kinds[1], v=version)]
                    assert await store.commit([entry(iid, version, *emits)])
                    await asyncio.sleep(0)

        async def claim(store: SqliteStore, owner: str) -> None:
            while len(claims) < total:
                got = await store.claim_messages(limits, lease=LONG, owner=owner)
                claims.extend(m.key for m in got)
                by_store[store is one] += len(got)
                for m in got:
                    handled.setdefault(m.instance_id, []).append((m.version, m.n))
                    await asyncio.sleep(0.001)  # the handler's work
                if got:
                    assert await store.finish_messages(keys(got)) == len(got)
                else:
                    await asyncio.sleep(0.005)

        async with asyncio.timeout(120):
            await asyncio.gather(
                produce(one, ids[::2]),
                produce(two, ids[1::2]),
                *(claim(s, f"{s is one}-{n}") for s in (one, two) for n in range(2)),
            )
        assert len(claims) == len(set(claims)) == total
        for iid in ids:
            assert handled[iid] == sorted(handled[iid])
            assert len(handled[iid]) == versions * 2
        assert all(by_store.values())  # both stores claimed: they did run side by side
        counts = await one.count_messages()
        assert counts == {"pending": 0, "running": 0, "done": total, "dead": 0}


async def test_claims_against_a_write_lock_held_elsewhere_wait(db_path: Path) -> None:
    """A claim waits for a write lock another connection holds (SQLite serialises writers)
    and claims once it is let go."""
    async with SqliteStore(db_path) as store:
        await emitted(store, "i", [emit()])
        holder = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        try:
            holder.execute("BEGIN IMMEDIATE")
            claim = asyncio.ensure_future(
                store.claim_messages({"notify": 1}, lease=LONG, owner="w")
            )
            await asyncio.sleep(0.2)
            assert not claim.done()
            holder.execute("COMMIT")
            got = await asyncio.wait_for(claim, 10)
        finally:
            holder.close()
        assert keys(got) == ["i:2:0"]
