"""Capacities, uniqueness and rate limits on every store (memory, SQLite, PostgreSQL: the
``store_factory`` fixture is parametrised), through a real engine and, for what only a store
sees (commit_many, apply_locked, create), through the store itself.

After the runs that move many instances, the slot events, slots, counters and rate events the
store keeps (`constraint_rows`) are checked by `prove` below: per key, events numbered from 1
without a gap, the holder count after each event the running sum of the takes and releases and
never above the limit, the counter equal to the slots held, each slot held by an instance in
the state under that key.

The checker's constraint rules (`flowlock.checker.check_constraints`) run after each test too,
over every instance and its history: clean.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sqlite3
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import flowlock
from age_kit import backdate
from flowlock import Capacity, Rate, State, Step, Transition, Unique, Workflow
from flowlock.checker import check_constraints
from flowlock.checker.constraints import slot_rules
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery, Snapshot
from flowlock.locks import MemoryLocks
from flowlock.stores import Store
from flowlock.stores.base import RowLock
from flowlock.stores.constraint_store import ConstraintRows, ConstraintStore
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore
from lock_probes import wait_until

StoreFactory = Callable[..., Store]

REVIEW = "review.in_review"
SUB = "sub.unique"
PING = "pinger.ping.rate"
PER = 0.3  # a rate limit's window, seconds


def reviewer(inst: Instance) -> object:
    return inst.data.get("r")


def customer(inst: Instance) -> object:
    return inst.data.get("customer")


def account(inst: Instance) -> object:
    return inst.data.get("account")


def reassign(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    return Step(data={**inst.data, "r": payload["to"]})


def review(limit: int = 2, strategy: str | None = None) -> Workflow:
    """draft -> in_review (at most `limit` per reviewer) -> done -> draft again."""
    return Workflow(
        "review",
        strategy=strategy,  # type: ignore[arg-type]
        states=["draft", State("in_review", capacity=Capacity(reviewer, limit)), "done"],
        initial="draft",
        transitions=[
            Transition("submit", source="draft", target="in_review"),
            Transition("note", source="in_review", target="in_review"),
            Transition("reassign", source="in_review", target="in_review", effect=reassign),
            Transition("finish", source="in_review", target="done"),
            Transition("reopen", source="done", target="draft"),
        ],
    )


def subscription() -> Workflow:
    """One active (or suspended) subscription per customer, from its creation."""
    return Workflow(
        "sub",
        states=["active", "suspended", "cancelled"],
        initial="active",
        unique=Unique(customer, ["active", "suspended"]),
        transitions=[
            Transition("suspend", source="active", target="suspended"),
            Transition("cancel", source=("active", "suspended"), target="cancelled"),
        ],
    )


def pinger(limit: int = 2, per: float = PER) -> Workflow:
    """`ping` at most `limit` times per account in any `per` seconds."""
    rate = Rate(account, timedelta(seconds=per), limit)
    return Workflow(
        "pinger",
        states=["on"],
        initial="on",
        transitions=[Transition("ping", source="on", target="on", rate=rate)],
    )


def constraint_store(store: Store) -> ConstraintStore:
    """`store` as the ConstraintStore every store is."""
    assert isinstance(store, ConstraintStore), type(store).__name__
    return store


async def _open(store_factory: StoreFactory, *workflows: Workflow) -> flowlock.Engine:
    store = store_factory()
    constraint_store(store)
    eng = await flowlock.Engine(store, locks=MemoryLocks()).open()
    for wf in workflows:
        await eng.register(wf)
    return eng


@pytest.fixture
async def engine(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """An open engine with review (capacity 2), sub (unique) and pinger (2 per PER s)."""
    eng = await _open(store_factory, review(), subscription(), pinger())
    try:
        yield eng
    finally:
        await eng.aclose()


def cs(engine: flowlock.Engine) -> ConstraintStore:
    return constraint_store(engine.store)


async def holders(engine: flowlock.Engine, kind: str, key: str) -> tuple[str, ...]:
    return (await cs(engine).capacity_usage(kind, key)).holders


async def drafts(engine: flowlock.Engine, n: int, r: str = "ann", prefix: str = "d") -> list[str]:
    ids = [f"{prefix}{i}" for i in range(n)]
    for iid in ids:
        await engine.create("review", instance_id=iid, data={"r": r})
    return ids


def prove(rows: ConstraintRows, instances: Mapping[str, Instance] | None = None) -> None:
    """The store's constraint rows agree with each other (and with `instances`, the review
    instances by id, when given): see the module's docstring."""
    by_key: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for event in rows.log:
        by_key[(event.kind, event.key)].append(event)
    counters = {(c.kind, c.key): c for c in rows.counters}
    slots = Counter((s.kind, s.key) for s in rows.slots)
    for slot, events in by_key.items():
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), slot
        held = 0
        for e in events:
            held += e.delta
            assert e.delta in (1, -1) and e.holders == held, (slot, e)
            assert 0 <= e.holders <= e.limit, (slot, e)
        counter = counters[slot]
        assert (counter.holders, counter.seq) == (held, len(events)), slot
        assert slots[slot] == held, slot
    assert set(counters) >= set(slots)
    if instances is not None:
        for s in rows.slots:
            if s.kind == REVIEW:
                inst = instances[s.instance_id]
                assert (inst.state, inst.data["r"]) == ("in_review", s.key), s
        inside = Counter(i.data["r"] for i in instances.values() if i.state == "in_review")
        assert inside == Counter({k: n for (kind, k), n in slots.items() if kind == REVIEW})
    for kind_key in {(r.kind, r.key) for r in rows.rates}:
        times = sorted(r.at for r in rows.rates if (r.kind, r.key) == kind_key)
        limits = [r for r in rows.rates if (r.kind, r.key) == kind_key]
        for i, start in enumerate(times):
            within = [t for t in times[i:] if t < start + limits[0].per]
            assert len(within) <= limits[0].limit, (kind_key, within)


async def proven(engine: flowlock.Engine) -> ConstraintRows:
    """`prove` on the engine's store, and the checker's constraint rules over every instance and
    its history: clean."""
    rows = await cs(engine).constraint_rows()
    prove(rows)
    store = engine.store
    instances = await store.list_instances(InstanceQuery(), after=None, limit=10_000)
    history = [e for inst in instances for e in await store.history(inst.id)]
    rules = {name: slot_rules(wf) for name, wf in engine.workflows.items()}
    violations = check_constraints(rows, instances, history, rules)
    assert violations == [], violations
    return rows


# -- capacity ------------------------------------------------------------------------------------


async def test_a_full_key_refuses_entry_and_writes_nothing(engine: flowlock.Engine) -> None:
    """The third instance entering a state of capacity 2 for one key is refused with
    CapacityReached (key, limit, holders, version, event) and nothing of it is written."""
    a, b, c = await drafts(engine, 3)
    await engine.fire(a, "submit")
    await engine.fire(b, "submit")
    with pytest.raises(flowlock.CapacityReached) as refused:
        await engine.fire(c, "submit", request_id="try-c")
    err = refused.value
    assert (err.kind, err.key, err.limit, err.holders) == (REVIEW, "ann", 2, (a, b))
    assert (err.instance_id, err.version, err.event) == (c, 2, "submit")
    assert isinstance(err, ConstraintRefused) and isinstance(err, flowlock.TransitionRefused)
    inst = await engine.get(c)
    assert (inst.state, inst.version) == ("draft", 1)
    assert await engine.history(c) == []
    assert await holders(engine, REVIEW, "ann") == (a, b)
    usage = await engine.capacity(REVIEW, "ann")
    assert (usage.limit, usage.used, usage.free, usage.rule) == (2, 2, 0, "capacity")
    # The refused request id was not recorded: the same id applies once a slot is free.
    await engine.fire(a, "finish")
    assert (await engine.fire(c, "submit", request_id="try-c")).applied
    await proven(engine)


async def test_leaving_the_state_frees_the_slot(engine: flowlock.Engine) -> None:
    """A holder that leaves the state gives its slot back in that commit, and the release is
    heard by slot_releases listeners."""
    a, b, c = await drafts(engine, 3)
    await engine.fire(a, "submit")
    await engine.fire(b, "submit")
    heard: list[tuple[str, str]] = []
    async with cs(engine).slot_releases(lambda kind, key: heard.append((kind, key))):
        await engine.fire(a, "finish")
        # At once on memory and SQLite; on PostgreSQL once its NOTIFY arrives, or as
        # ("", "") (anything may have been released) if it came before LISTEN was on.
        await wait_until(
            lambda: bool({(REVIEW, "ann"), ("", "")} & set(heard)), what="the release heard"
        )
    assert await holders(engine, REVIEW, "ann") == (b,)
    await engine.fire(c, "submit")
    assert await holders(engine, REVIEW, "ann") == (b, c)
    # Back to draft and in again: a new slot, once one is free.
    await engine.fire(a, "reopen")
    with pytest.raises(flowlock.CapacityReached):
        await engine.fire(a, "submit")
    await proven(engine)


async def test_a_waiting_entry_is_woken_when_a_slot_is_released(
    store_factory: StoreFactory,
) -> None:
    """With Capacity(wait=), an entry into a full key waits, and enters once the holder leaves
    through another engine on the same database (woken by the release as that store hears it:
    NOTIFY on PostgreSQL, SQLite's look every second, the shared memory store at once)."""
    waiting = Workflow(
        "review",
        states=["draft", State("in_review", capacity=Capacity(reviewer, 1, wait=20.0)), "done"],
        initial="draft",
        transitions=[
            Transition("submit", source="draft", target="in_review"),
            Transition("finish", source="in_review", target="done"),
        ],
    )
    here = await _open(store_factory, waiting)
    there = await _open(store_factory, waiting)
    try:
        a, b = await drafts(here, 2)
        await here.fire(a, "submit")
        entering = asyncio.create_task(here.fire(b, "submit"))
        await asyncio.sleep(0.2)  # b is waiting (were it refused, the task says so below)
        assert not entering.done()
        await there.fire(a, "finish")
        async with asyncio.timeout(15):  # a bound, well under b's own wait
            outcome = await entering
        assert outcome.applied and await holders(here, REVIEW, "ann") == (b,)
        await proven(here)
    finally:
        await there.aclose()
        await here.aclose()


async def test_limit_one_is_a_mutex_per_key(store_factory: StoreFactory) -> None:
    """With limit=1 one instance per key is inside; other keys are not held up."""
    eng = await _open(store_factory, review(limit=1))
    try:
        for iid, r in [("x1", "ann"), ("x2", "ann"), ("y1", "bob")]:
            await eng.create("review", instance_id=iid, data={"r": r})
        await eng.fire("x1", "submit")
        await eng.fire("y1", "submit")
        with pytest.raises(flowlock.CapacityReached) as refused:
            await eng.fire("x2", "submit")
        assert refused.value.holders == ("x1",) and refused.value.limit == 1
        await eng.fire("x1", "finish")
        await eng.fire("x2", "submit")
        assert await holders(eng, REVIEW, "ann") == ("x2",)
        assert await holders(eng, REVIEW, "bob") == ("y1",)
        await proven(eng)
    finally:
        await eng.aclose()


async def test_a_key_that_changes_moves_the_slot(engine: flowlock.Engine) -> None:
    """A transition that stays in the state but changes the key gives back the old key's slot
    and takes one of the new key, in one commit; into a full key it is refused and the old
    slot stays. A transition that keeps the key changes nothing."""
    a, b = await drafts(engine, 2)
    (c,) = await drafts(engine, 1, r="bob", prefix="b")
    await engine.fire(a, "submit")
    await engine.fire(b, "submit")
    await engine.fire(c, "submit")
    await engine.fire(a, "note")  # same key: nothing moves
    assert await holders(engine, REVIEW, "ann") == (a, b)
    await engine.fire(a, "reassign", payload={"to": "bob"})
    assert await holders(engine, REVIEW, "ann") == (b,)
    assert await holders(engine, REVIEW, "bob") == (c, a)
    with pytest.raises(flowlock.CapacityReached):
        await engine.fire(b, "reassign", payload={"to": "bob"})
    assert await holders(engine, REVIEW, "ann") == (b,)
    assert (await engine.get(b)).data == {"r": "ann"}
    rows = await proven(engine)
    prove(rows, {i.id: i for i in [await engine.get(x) for x in (a, b, c)]})


# -- uniqueness ----------------------------------------------------------------------------------


async def test_a_store_create_with_a_unique_claim_refuses_a_second(
    engine: flowlock.Engine,
) -> None:
    """store.create applies its claims in the insert's transaction: a second take of a
    unique key is UniqueViolation naming the holder (version 1, event None), and the second
    instance does not exist; a create answered from its request id applies none."""
    store = engine.store
    take = Claim("take", SUB, "c-1", 1, unique=True)
    first = Instance(id="s1", workflow="sub", state="active", version=1, data={"customer": "c-1"})
    await store.create(first, "mk-s1", (), (take,))
    again = await store.create(first, "mk-s1", (), (take,))  # answered from its key
    assert again.id == "s1"
    second = dataclasses.replace(first, id="s2")
    with pytest.raises(flowlock.UniqueViolation) as refused:
        await store.create(second, "mk-s2", (), (take,))
    err = refused.value
    assert (err.holder, err.key, err.kind, err.version, err.event) == ("s1", "c-1", SUB, 1, None)
    with pytest.raises(flowlock.InstanceNotFound):
        await store.get("s2")
    assert await store.create_request("s2") is None
    assert await holders(engine, SUB, "c-1") == ("s1",)
    await proven(engine)


async def test_unique_in_the_initial_state_refuses_a_second_create(
    engine: flowlock.Engine,
) -> None:
    """Unique over the initial state: a second create for the same customer is refused with
    UniqueViolation (the holder named) and writes nothing; once the first is cancelled, a new
    one is created."""
    await engine.create("sub", instance_id="s1", data={"customer": "c-1"})
    await engine.create("sub", instance_id="other", data={"customer": "c-2"})
    with pytest.raises(flowlock.UniqueViolation) as refused:
        await engine.create("sub", instance_id="s2", data={"customer": "c-1"})
    assert refused.value.holder == "s1"
    with pytest.raises(flowlock.InstanceNotFound):
        await engine.get("s2")
    await engine.fire("s1", "suspend")  # still in the rule's states: still held
    with pytest.raises(flowlock.UniqueViolation):
        await engine.create("sub", instance_id="s2", data={"customer": "c-1"})
    await engine.fire("s1", "cancel")
    await engine.create("sub", instance_id="s2", data={"customer": "c-1"})
    assert await holders(engine, SUB, "c-1") == ("s2",)
    await proven(engine)


# -- rate limits ---------------------------------------------------------------------------------


async def test_a_rate_limit_refuses_past_the_limit_and_allows_after_the_window(
    engine: flowlock.Engine,
) -> None:
    """The (limit+1)th ping within the window is refused with RateLimited (retry_after above 0
    and at most the window) and counts nothing; after retry_after it applies. Another key has
    its own window."""
    await engine.create("pinger", instance_id="p", data={"account": "acme"})
    await engine.create("pinger", instance_id="q", data={"account": "other"})
    refused: flowlock.RateLimited | None = None
    applied = 0
    for _ in range(20):  # a slow machine may let a window pass between two pings
        try:
            await engine.fire("p", "ping")
            applied += 1
        except flowlock.RateLimited as exc:
            refused = exc
            break
    assert refused is not None and applied >= 2
    assert (refused.kind, refused.key, refused.limit, refused.per) == (PING, "acme", 2, PER)
    assert 0 < refused.retry_after <= PER
    assert (refused.instance_id, refused.event) == ("p", "ping")
    assert refused.version == (await engine.get("p")).version + 1
    assert (await engine.fire("q", "ping")).applied  # its own key
    await asyncio.sleep(refused.retry_after + 0.05)
    assert (await engine.fire("p", "ping")).applied
    usage = await cs(engine).capacity_usage(PING, "acme", window=60.0)
    assert usage.holders == ("p",) * (applied + 1) and usage.limit == 2
    rows = await proven(engine)
    assert sum(1 for r in rows.rates if r.key == "acme") == applied + 1


async def test_a_lowered_rate_limit_counts_what_the_window_holds(engine: flowlock.Engine) -> None:
    """Applications counted under a higher limit still count after the limit is lowered: the
    count is refused until enough of them leave the window (retry_after: until the oldest of
    the newest `limit` leaves, most of the window here)."""
    store = engine.store
    await engine.create("pinger", instance_id="p", data={"account": "acme"})
    for limit in (5, 5, 5):
        inst = await store.get("p")
        made = await store.commit(
            [_entry(inst, "ping", "on", Claim("count", PING, "acme", limit, 60.0))]
        )
        assert made is not None
    inst = await store.get("p")
    with pytest.raises(flowlock.RateLimited) as refused:
        await store.commit([_entry(inst, "ping", "on", Claim("count", PING, "acme", 2, 60.0))])
    assert 50.0 < refused.value.retry_after <= 60.0
    assert (refused.value.limit, refused.value.version) == (2, inst.version + 1)
    assert (await store.get("p")).version == inst.version
    await proven(engine)


# -- repairs ---------------------------------------------------------------------------------


async def test_force_into_a_full_state_is_refused_and_out_of_it_frees(
    engine: flowlock.Engine,
) -> None:
    """engine.force takes a slot like a transition: into a full key it is refused (nothing
    written); forced out of the state, the holder gives its slot back."""
    a, b, c = await drafts(engine, 3)
    await engine.fire(a, "submit")
    await engine.fire(b, "submit")
    with pytest.raises(flowlock.CapacityReached):
        await engine.force(c, "in_review", reason="rush", actor="ops")
    assert (await engine.get(c)).version == 1
    await engine.force(a, "done", reason="closed by hand", actor="ops")
    assert await holders(engine, REVIEW, "ann") == (b,)
    await engine.force(c, "in_review", reason="rush", actor="ops")
    assert await holders(engine, REVIEW, "ann") == (b, c)
    await proven(engine)


async def test_pause_and_resume_keep_the_slot(engine: flowlock.Engine) -> None:
    """A paused holder keeps its slot (pause and resume change no state); forced out while
    paused, it frees it."""
    a, b, c = await drafts(engine, 3)
    await engine.fire(a, "submit")
    await engine.fire(b, "submit")
    await engine.pause(a, reason="audit", actor="ops")
    assert await holders(engine, REVIEW, "ann") == (a, b)
    with pytest.raises(flowlock.CapacityReached):
        await engine.fire(c, "submit")
    await engine.resume(a, actor="ops")
    assert await holders(engine, REVIEW, "ann") == (a, b)
    await engine.pause(b, reason="audit", actor="ops")
    await engine.force(b, "done", reason="closed by hand", actor="ops")
    assert await holders(engine, REVIEW, "ann") == (a,)
    await proven(engine)


# -- retention and other engines -------------------------------------------------------------


def ledger() -> Workflow:
    """A final state with a capacity: its slots are held until retention purges the holder."""
    return Workflow(
        "ledger",
        states=["open", State("closed", capacity=Capacity(reviewer, 5))],
        initial="open",
        transitions=[Transition("close", source="open", target="closed")],
    )


async def test_a_purge_frees_the_slots_of_what_it_deletes(store_factory: StoreFactory) -> None:
    """An instance that holds a slot in a final state gives it back when retention purges it,
    and the release is logged like any other."""
    eng = await _open(store_factory, ledger())
    try:
        for iid in ("l1", "l2", "l3"):
            await eng.create("ledger", instance_id=iid, data={"r": "ann"})
            await eng.fire(iid, "close")
        await backdate(eng.store, ["l1", "l2"])
        report = await eng.purge("ledger", older_than=timedelta(minutes=10))
        assert report.purged == 2
        assert await holders(eng, "ledger.closed", "ann") == ("l3",)
        rows = await proven(eng)
        freed = sorted((e.instance_id, e.delta) for e in rows.log if e.delta < 0)
        assert freed == [("l1", -1), ("l2", -1)]
    finally:
        await eng.aclose()


async def test_a_release_by_another_engine_is_heard(store_factory: StoreFactory) -> None:
    """A slot released by an engine on another store object of the same database reaches this
    store's slot_releases listeners: as its (kind, key) where the store can hear it, else as
    ("", "") within a bound (SQLite looks again every second)."""
    here = await _open(store_factory, review(limit=1))
    there = await _open(store_factory, review(limit=1))
    try:
        (a,) = await drafts(here, 1)
        await here.fire(a, "submit")
        heard: list[tuple[str, str]] = []
        async with cs(here).slot_releases(lambda kind, key: heard.append((kind, key))):
            await there.fire(a, "finish")
            await wait_until(
                lambda: bool({(REVIEW, "ann"), ("", "")} & set(heard)),
                within=10.0,
                what="the release heard here",
            )
        assert await holders(here, REVIEW, "ann") == ()
    finally:
        await there.aclose()
        await here.aclose()


# -- the store's own paths -----------------------------------------------------------------------


def _entry(inst: Instance, event: str, to: str, *claims: Claim) -> HistoryEntry:
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1,
        event=event,
        from_state=inst.state,
        to_state=to,
        actor=None,
        request_id=f"{inst.id}-{inst.version + 1}",
        strategy="optimistic",
        data=dict(inst.data),
        claims=claims,
    )


def _chain(inst: Instance, *steps: tuple[str, str, tuple[Claim, ...]]) -> list[HistoryEntry]:
    """One batch of entries from `inst`: each (event, target, claims) one version on."""
    batch: list[HistoryEntry] = []
    for event, to, claims in steps:
        entry = _entry(inst, event, to, *claims)
        batch.append(entry)
        inst = dataclasses.replace(inst, version=entry.version, state=to)
    return batch


async def test_the_entries_of_one_batch_claim_in_order_all_or_nothing(
    engine: flowlock.Engine,
) -> None:
    """A batch's entries apply their claims in order, each seeing the ones before (in, out
    and in again under another key); when a later entry's claim is refused, nothing of the
    batch stays: not the slot an earlier entry took, not one event."""
    store = engine.store
    a, b = await drafts(engine, 2)
    (c,) = await drafts(engine, 1, r="bob", prefix="b")
    await engine.fire(c, "submit")  # bob's only slot (limit 1 below) is c's
    take_ann, take_bob = Claim("take", REVIEW, "ann", 1), Claim("take", REVIEW, "bob", 1)
    leave = (Claim("release", REVIEW),)
    before = await cs(engine).constraint_rows()
    refused_batch = _chain(
        await store.get(a),
        ("submit", "in_review", (take_ann,)),
        ("finish", "done", leave),
        ("reopen", "draft", ()),
        ("submit", "in_review", (take_bob,)),
    )
    with pytest.raises(flowlock.CapacityReached) as refused:
        await store.commit(refused_batch)
    assert (refused.value.key, refused.value.version, refused.value.holders) == ("bob", 5, (c,))
    assert (await store.get(a)).version == 1
    assert await cs(engine).constraint_rows() == before
    fitting = _chain(
        await store.get(b),
        ("submit", "in_review", (take_ann,)),
        ("finish", "done", leave),
        ("reopen", "draft", ()),
        ("submit", "in_review", (take_ann,)),
    )
    assert await store.commit(fitting) is not None
    assert await holders(engine, REVIEW, "ann") == (b,)
    log = [(e.seq, e.delta, e.holders, e.version) for e in (await cs(engine).constraint_rows()).log
           if e.key == "ann"]  # fmt: skip
    assert log == [(1, 1, 1, 2), (2, -1, 0, 3), (3, 1, 1, 5)]
    await proven(engine)


async def test_commit_many_answers_a_refused_batch_at_its_place(engine: flowlock.Engine) -> None:
    """In commit_many a batch whose claim is refused answers its ConstraintRefused, writes
    nothing, and the other batches commit."""
    store = engine.store
    a, b, c = await drafts(engine, 3)
    take = Claim("take", REVIEW, "ann", 1)
    got = {iid: await store.get(iid) for iid in (a, b, c)}
    answers = await store.commit_many(
        [
            [_entry(got[a], "submit", "in_review", take)],
            [_entry(got[b], "submit", "in_review", take)],  # the key is full by now
            [_entry(got[c], "note", "draft")],
        ]
    )
    first, refused, third = answers
    assert isinstance(first, Instance) and first.state == "in_review"
    assert isinstance(refused, flowlock.CapacityReached)
    assert (refused.instance_id, refused.holders, refused.version) == (b, (a,), 2)
    assert isinstance(third, Instance) and third.version == 2
    assert (await store.get(b)).version == 1 and await store.history(b) == []
    assert await holders(engine, REVIEW, "ann") == (a,)
    await proven(engine)


async def test_a_refused_claim_under_the_row_lock_writes_nothing(engine: flowlock.Engine) -> None:
    """apply_locked applies the plan's claims in its transaction: a refused one raises and
    nothing of the plan is written (the slot released before it in the same commit included)."""
    store = engine.store
    a, b = await drafts(engine, 2)
    (c,) = await drafts(engine, 1, r="bob", prefix="b")
    await engine.fire(a, "submit")
    await engine.fire(b, "submit")
    await engine.fire(c, "submit")
    move = (Claim("release", REVIEW), Claim("take", REVIEW, "bob", 1))

    def plan(snap: Snapshot) -> list[HistoryEntry]:
        return [_entry(snap.instance, "reassign", "in_review", *move)]

    with pytest.raises(flowlock.CapacityReached):
        await store.apply_locked(a, [], plan, RowLock(timeout=5.0))
    assert (await store.get(a)).version == 2
    assert await holders(engine, REVIEW, "ann") == (a, b)
    assert await holders(engine, REVIEW, "bob") == (c,)
    await proven(engine)


# -- concurrency ---------------------------------------------------------------------------------


async def test_concurrent_calls_on_one_instance_batched(engine: flowlock.Engine) -> None:
    """Many concurrent calls on one instance (batched together): the slot is taken once, every
    `note` applies, and of concurrent rate-limited pings no more than the limit apply, the
    others refused with RateLimited."""
    (a,) = await drafts(engine, 1)
    await engine.fire(a, "submit")
    notes = await asyncio.gather(*(engine.fire(a, "note") for _ in range(20)))
    assert all(o.applied for o in notes)
    assert await holders(engine, REVIEW, "ann") == (a,)
    await engine.register(pinger(limit=5, per=60.0))
    await engine.create("pinger", instance_id="p", data={"account": "acme"})
    pings = await asyncio.gather(
        *(engine.fire("p", "ping") for _ in range(12)), return_exceptions=True
    )
    applied = [p for p in pings if isinstance(p, flowlock.Outcome) and p.applied]
    assert len(applied) == 5, pings
    assert all(isinstance(p, flowlock.RateLimited) for p in pings if p not in applied)
    await proven(engine)


async def raw_slots(store: Store) -> Counter[str]:
    """The review slots held per key, counted with the test's own SQL where there is SQL."""
    if isinstance(store, SqliteStore):
        conn = sqlite3.connect(store.path)
        try:
            found = conn.execute(
                "SELECT key, count(*) FROM flowlock_slots WHERE kind = ? GROUP BY key", (REVIEW,)
            ).fetchall()
        finally:
            conn.close()
    elif isinstance(store, PostgresStore):
        assert store.dsn is not None
        conn_pg = await asyncpg.connect(store.dsn)
        try:
            await conn_pg.execute(f'SET search_path TO "{store.schema}"')
            found = await conn_pg.fetch(
                "SELECT key, count(*) FROM flowlock_slots WHERE kind = $1 GROUP BY key", REVIEW
            )
        finally:
            await conn_pg.close()
    else:
        rows = await constraint_store(store).constraint_rows()
        return Counter(s.key for s in rows.slots if s.kind == REVIEW)
    return Counter({key: int(n) for key, n in found})


@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_concurrent_tasks_never_exceed_the_limit(
    store_factory: StoreFactory, strategy: str
) -> None:
    """Tasks on two engines (two store objects of one database, like two processes) move 24
    instances in and out of a state of capacity 2 over 3 keys, all at once, and stay inside
    in the end: the slot rows counted per key are 2, the instances inside, and the store's
    events prove no key ever held more."""
    engines = [await _open(store_factory, review(limit=2, strategy=strategy)) for _ in range(2)]
    eng = engines[0]
    try:
        keys = ["ann", "bob", "cat"]
        ids = [f"i{n:02d}" for n in range(24)]
        for n, iid in enumerate(ids):
            await eng.create("review", instance_id=iid, data={"r": keys[n % 3]})
        entered = Counter[str]()
        refusals: list[str] = []
        everyone = asyncio.Barrier(len(ids))

        async def enter(mine: flowlock.Engine, iid: str, tries: int, rng: random.Random) -> bool:
            for _ in range(tries):  # bounded: each try is one commit
                try:
                    await mine.fire(iid, "submit")
                except flowlock.CapacityReached:
                    refusals.append(iid)
                    await asyncio.sleep(rng.uniform(0.001, 0.01))
                    continue
                entered[iid] += 1
                await mine.fire(iid, "note")
                return True
            return False  # starved: allowed, the limit is what is checked

        async def run(n: int, iid: str) -> None:
            rng = random.Random(iid)
            mine = engines[n % 2]
            for _ in range(2):
                if await enter(mine, iid, 400, rng):
                    await mine.fire(iid, "finish")
                    await mine.fire(iid, "reopen")
            await everyone.wait()  # then all at once again, and those who get in stay
            await enter(mine, iid, 10, rng)

        async with asyncio.timeout(120):
            await asyncio.gather(*(run(n, iid) for n, iid in enumerate(ids)))
        assert sum(entered.values()) > 0 and refusals  # they did contend
        assert await raw_slots(eng.store) == Counter(dict.fromkeys(keys, 2))
        rows = await cs(eng).constraint_rows()
        takes = [e for e in rows.log if e.delta == 1]
        assert len(takes) == sum(entered.values())
        assert max(e.holders for e in rows.log) <= 2
        prove(rows, {iid: await eng.get(iid) for iid in ids})
        await proven(eng)
    finally:
        for each in engines:
            await each.aclose()
