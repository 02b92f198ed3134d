"""Queries (``Engine.list``, ``Engine.count`` and the stores' ``list_instances`` /
``count_instances``), one contract for every store: memory, SQLite, PostgreSQL (the
``store_factory`` and ``engine`` fixtures are parametrised).

What the tests expect is computed by the test from the instances themselves (their ids, states
and the ``updated_at`` each store stamped), never by the query code under test; the order is
Python's ``sorted`` over the ids (code point order).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import pytest

import flowlock
from flowlock.checker import check_many
from flowlock.core.models import HistoryEntry, Instance, InstanceQuery
from flowlock.core.query import cursor_after
from flowlock.stores import MemoryStore, Store

StoreFactory = Callable[..., Store]

# Ids whose code point order differs from most collations' order (case, punctuation, digits,
# accents, scripts, a character beyond the BMP): every store must sort them as Python does.
TRICKY_IDS = [
    "a", "B", "b", "a-1", "a_1", "a1", "A1", "10", "9", "é", "e", "z", "Z", "Ω", "日本",
    "😀", "a b", "a.b", "~", "ab", "aB",
]  # fmt: skip


@asynccontextmanager
async def opened(store: Store) -> AsyncIterator[Store]:
    await store.open()
    try:
        yield store
    finally:
        await store.aclose()


def move(inst: Instance, to: str) -> HistoryEntry:
    """The history entry that moves ``inst`` to state ``to``."""
    return HistoryEntry(
        instance_id=inst.id,
        version=inst.version + 1,
        event="go",
        from_state=inst.state,
        to_state=to,
        actor=None,
        request_id=None,
        strategy="optimistic",
        data=dict(inst.data),
    )


async def walk(engine: flowlock.Engine, **filters: Any) -> list[flowlock.Page]:
    """Every page of ``engine.list(**filters)``, following next_cursor to the end (at most 10_000
    pages: a pager that never ends fails the test instead of hanging it)."""
    pages = [await engine.list(**filters)]
    while pages[-1].next_cursor is not None:
        assert len(pages) < 10_000, "the walk does not end"
        pages.append(await engine.list(**filters, after=pages[-1].next_cursor))
    return pages


def at(inst: Instance) -> datetime:
    """The instance's updated_at, which every store stamps."""
    assert inst.updated_at is not None
    return inst.updated_at


def ids(pages: Sequence[Sequence[Instance]]) -> list[str]:
    return [inst.id for page in pages for inst in page]


# -- the store port ------------------------------------------------------------------------------


async def test_store_lists_by_id_in_code_point_order(store_factory: StoreFactory) -> None:
    """list_instances returns instances by id in code point order (Python's str order, whatever
    the database's collation), starting after ``after`` and at most ``limit`` of them;
    count_instances counts them."""
    async with opened(store_factory()) as store:
        for iid in TRICKY_IDS:
            await store.create(Instance(id=iid, workflow="w", state="s", version=1, data={}))
        everything = InstanceQuery()
        expected = sorted(TRICKY_IDS)
        listed = await store.list_instances(everything, after=None, limit=1000)
        assert [i.id for i in listed] == expected
        assert all(isinstance(i, Instance) and i.workflow == "w" for i in listed)
        for k in (0, 5, len(expected) - 2, len(expected) - 1):
            page = await store.list_instances(everything, after=expected[k], limit=3)
            assert [i.id for i in page] == expected[k + 1 : k + 4]
        assert await store.list_instances(everything, after="\U0010ffff", limit=5) == []
        assert await store.count_instances(everything) == len(TRICKY_IDS)


async def test_store_filters_by_workflow_state_and_time(store_factory: StoreFactory) -> None:
    """Each filter (workflow, one state, several states, updated_before, updated_after) and
    their combinations select exactly the instances the test computes from the stored values;
    a workflow or state nobody has finds nothing."""
    async with opened(store_factory()) as store:
        made: dict[str, Instance] = {}
        for n in range(30):
            workflow = "approval" if n % 3 else "ticket"
            inst = await store.create(
                Instance(id=f"i{n:02d}", workflow=workflow, state="a", version=1, data={})
            )
            if n % 4 == 1:
                moved = await store.commit((move(inst, "b"),))
                assert moved is not None
                inst = moved
            elif n % 4 == 2:
                moved = await store.commit((move(inst, "c"),))
                assert moved is not None
                inst = moved
            made[inst.id] = inst
        stamps = sorted({at(i) for i in made.values()})
        assert len(stamps) >= 3
        middle = stamps[len(stamps) // 2]

        cases: list[tuple[InstanceQuery, Callable[[Instance], bool]]] = [
            (InstanceQuery(), lambda i: True),
            (InstanceQuery(workflow="approval"), lambda i: i.workflow == "approval"),
            (InstanceQuery(states=("b",)), lambda i: i.state == "b"),
            (InstanceQuery(states=("a", "c")), lambda i: i.state in ("a", "c")),
            (
                InstanceQuery(workflow="ticket", states=("a",)),
                lambda i: i.workflow == "ticket" and i.state == "a",
            ),
            (InstanceQuery(updated_before=middle), lambda i: at(i) < middle),
            (InstanceQuery(updated_after=middle), lambda i: at(i) > middle),
            (
                InstanceQuery(
                    workflow="approval",
                    states=("a", "b"),
                    updated_after=stamps[0],
                    updated_before=stamps[-1],
                ),
                lambda i: (
                    i.workflow == "approval"
                    and i.state in ("a", "b")
                    and stamps[0] < at(i) < stamps[-1]
                ),
            ),
            (InstanceQuery(workflow="nobody"), lambda i: False),
            (InstanceQuery(states=("nowhere",)), lambda i: False),
        ]
        for query, wanted in cases:
            expected = sorted(iid for iid, inst in made.items() if wanted(inst))
            listed = await store.list_instances(query, after=None, limit=1000)
            assert [i.id for i in listed] == expected, query
            assert listed == [made[iid] for iid in expected], query
            assert await store.count_instances(query) == len(expected), query


async def test_store_compares_moments_not_their_text(store_factory: StoreFactory) -> None:
    """updated_before / updated_after compare moments: the same moment in another timezone,
    or one microsecond either side of an instance's updated_at, selects the same instances."""
    async with opened(store_factory()) as store:
        inst = await store.create(Instance(id="x", workflow="w", state="s", version=1, data={}))
        stamp = inst.updated_at
        assert stamp is not None
        tick = timedelta(microseconds=1)
        east = timezone_east(stamp)
        for before, found in [(stamp, 0), (stamp + tick, 1), (east + tick, 1), (east, 0)]:
            query = InstanceQuery(updated_before=before)
            assert await store.count_instances(query) == found, before
        for after, found in [(stamp, 0), (stamp - tick, 1), (east - tick, 1)]:
            query = InstanceQuery(updated_after=after)
            assert len(await store.list_instances(query, after=None, limit=5)) == found, after


def timezone_east(moment: datetime) -> datetime:
    """The same moment, written in UTC+05:30."""
    return moment.astimezone(timezone(timedelta(hours=5, minutes=30)))


# -- the engine ----------------------------------------------------------------------------------


async def populate(engine: flowlock.Engine) -> dict[str, Instance]:
    """23 pending approvals, 5 approved, 3 rejected, 4 open and 2 closed tickets: every
    instance as committed, by id."""
    for n in range(31):
        await engine.create("approval", instance_id=f"req-{n:03d}", data={"n": n})
    for n in range(5):
        await engine.fire(f"req-{n * 6:03d}", "approve")
    for n in (1, 2, 3):
        await engine.fire(f"req-{n * 7 + 1:03d}", "reject")
    for n in range(6):
        await engine.create("ticket", instance_id=f"tk-{n}")
    for n in (0, 3):
        await engine.fire(f"tk-{n}", "close")
    return {i.id: i for i in ids_to_instances(await walk(engine, limit=1000))}


def ids_to_instances(pages: Sequence[flowlock.Page]) -> list[Instance]:
    return [inst for page in pages for inst in page]


async def test_pages_return_every_match_once_in_id_order(engine: flowlock.Engine) -> None:
    """Walking the pending approvals five at a time returns each exactly once, in id order,
    in full pages but the last, whose next_cursor is None; a walk whose matches fill its pages
    exactly ends on a full page, not on an empty one."""
    made = await populate(engine)
    pending = sorted(iid for iid, i in made.items() if i.state == "pending")
    assert len(pending) == 23

    pages = await walk(engine, workflow="approval", state="pending", limit=5)
    assert [len(p) for p in pages] == [5, 5, 5, 5, 3]
    assert ids(pages) == pending
    assert all(p.next_cursor is not None for p in pages[:-1]) and pages[-1].next_cursor is None
    assert ids_to_instances(pages) == [made[iid] for iid in pending]

    approved = sorted(iid for iid, i in made.items() if i.state in ("approved", "rejected"))
    assert len(approved) == 8
    exact = await walk(engine, workflow="approval", state=["approved", "rejected"], limit=4)
    assert [len(p) for p in exact] == [4, 4] and exact[-1].next_cursor is None
    assert ids(exact) == approved

    assert ids(await walk(engine, limit=7)) == sorted(made)
    assert ids(await walk(engine, state=("open",))) == ["tk-1", "tk-2", "tk-4", "tk-5"]


async def test_count_agrees_with_the_walk(engine: flowlock.Engine) -> None:
    """count takes list's filters and counts what a walk returns."""
    made = await populate(engine)
    middle = sorted(at(i) for i in made.values())[20]
    every: list[dict[str, Any]] = [
        {},
        {"workflow": "approval"},
        {"workflow": "approval", "state": "pending"},
        {"state": {"open", "closed"}},
        {"workflow": "ticket", "state": ["closed"]},
        {"updated_before": middle},
        {"workflow": "approval", "updated_after": middle},
    ]
    for filters in every:
        walked = ids(await walk(engine, limit=3, **filters))
        assert await engine.count(**filters) == len(walked), filters
    assert await engine.count("approval", "pending") == 23


async def test_a_page_is_a_read_only_sequence(engine: flowlock.Engine) -> None:
    """A Page supports len, indexing (negative too), slicing, iteration, ``in`` and truth; it
    is a frozen flowlock.Page whose next_cursor is a string or None."""
    await populate(engine)
    page = await engine.list("approval", "pending", limit=3)
    assert isinstance(page, flowlock.Page) and isinstance(page, Sequence)
    assert len(page) == 3 and bool(page)
    assert [i.id for i in page] == ["req-001", "req-002", "req-003"]
    assert page[0].id == "req-001" and page[-1].id == "req-003"
    assert [i.id for i in page[1:]] == ["req-002", "req-003"]
    assert page[0] in page and list(page) == list(page.instances)
    assert isinstance(page.next_cursor, str)
    with pytest.raises(AttributeError):
        page.next_cursor = None  # type: ignore[misc]
    empty = await engine.list("approval", "escalated")
    assert len(empty) == 0 and not empty and empty.next_cursor is None


async def test_a_cursor_is_stable_and_portable(
    engine: flowlock.Engine, store_factory: StoreFactory
) -> None:
    """A cursor names a position, not a result set: reading the same page twice gives the same
    page, the cursor still works after instances were added before and after it, and another
    engine on the same database (another process, after a restart) continues from it."""
    await populate(engine)
    first = await engine.list("approval", "pending", limit=4)
    cursor = first.next_cursor
    assert cursor is not None
    second = await engine.list("approval", "pending", limit=4, after=cursor)
    assert await engine.list("approval", "pending", limit=4, after=cursor) == second
    await engine.create("approval", instance_id="req-000a")  # before the cursor: not seen
    await engine.create("approval", instance_id="req-005a")  # after it: seen in its place
    again = await engine.list("approval", "pending", limit=4, after=cursor)
    assert [i.id for i in again] == ["req-005", "req-005a", "req-007", "req-009"]
    async with flowlock.Engine(store_factory()) as other:  # nothing registered: still a query
        assert await other.list("approval", "pending", limit=4, after=cursor) == again


async def test_an_unregistered_workflow_is_a_query(engine: flowlock.Engine) -> None:
    """Filtering by a workflow this engine never registered is not an error: it finds what the
    database holds under that name (nothing here), as an admin tool would want."""
    await populate(engine)
    assert "payroll" not in engine.workflows
    page = await engine.list("payroll")
    assert list(page) == [] and page.next_cursor is None
    assert await engine.count(workflow="payroll", state="pending") == 0


NAIVE = datetime(2026, 1, 1, 12, 0)
AWARE = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

BAD_FILTERS: list[dict[str, Any]] = [
    {"workflow": ""},
    {"workflow": 7},
    {"workflow": "bad name"},
    {"workflow": "x" * 101},
    {"state": ""},
    {"state": []},
    {"state": ["pending", ""]},
    {"state": ["pending", 3]},
    {"state": 3},
    {"state": {"pending": 1}},
    {"state": b"pending"},
    {"state": [f"s{n}" for n in range(101)]},
    {"updated_before": NAIVE},
    {"updated_after": NAIVE},
    {"updated_before": date(2026, 1, 1)},
    {"updated_after": "2026-01-01T00:00:00+00:00"},
    {"updated_before": 1_700_000_000},
    {"updated_after": AWARE, "updated_before": AWARE},
    {"updated_after": AWARE + timedelta(seconds=1), "updated_before": AWARE},
]
BAD_PAGES: list[dict[str, Any]] = [
    {"limit": 0},
    {"limit": -1},
    {"limit": 1001},
    {"limit": True},
    {"limit": 1.0},
    {"limit": "10"},
    {"limit": None},
    {"after": ""},
    {"after": "not a cursor!"},
    {"after": "abc="},
    {"after": "QUJD"},  # valid base64 of "ABC": not one of ours
    {"after": cursor_after("req-001") + "="},
    {"after": cursor_after("req-001")[:-1] + "*"},
    {"after": 12},
    {"after": b"aTE6cmVxLTAwMQ"},
    {"after": "x" * 5000},
]


@dataclass
class Recorded:
    """What the store was asked (a spy around a real store)."""

    calls: list[str] = field(default_factory=list)


async def test_bad_arguments_raise_invalid_input_and_change_nothing(
    engine: flowlock.Engine,
) -> None:
    """Every malformed filter, limit or cursor raises InvalidInput naming the argument, list and
    count alike; the instances and their histories are as they were."""
    made = await populate(engine)
    histories = {iid: await engine.history(iid) for iid in made}
    for bad in BAD_FILTERS + BAD_PAGES:
        with pytest.raises(flowlock.InvalidInput) as raised:
            await engine.list(**bad)
        named = {"after": "after", "limit": "limit"}.get(next(iter(bad)), next(iter(bad)))
        assert named.split("_")[0] in str(raised.value), (bad, raised.value)
    for bad in BAD_FILTERS:
        with pytest.raises(flowlock.InvalidInput):
            await engine.count(**bad)
    assert {i.id: i for i in ids_to_instances(await walk(engine, limit=1000))} == made
    assert {iid: await engine.history(iid) for iid in made} == histories


async def test_bad_arguments_are_refused_before_the_store_is_asked() -> None:
    """InvalidInput comes before any I/O: the store's query methods are never called."""
    recorded = Recorded()

    class Spy(MemoryStore):
        async def list_instances(
            self, query: InstanceQuery, *, after: str | None, limit: int
        ) -> list[Instance]:
            recorded.calls.append("list")
            return await super().list_instances(query, after=after, limit=limit)

        async def count_instances(self, query: InstanceQuery) -> int:
            recorded.calls.append("count")
            return await super().count_instances(query)

    async with flowlock.Engine(Spy()) as engine:
        for bad in BAD_FILTERS + BAD_PAGES:
            with pytest.raises(flowlock.InvalidInput):
                await engine.list(**bad)
        for bad in BAD_FILTERS:
            with pytest.raises(flowlock.InvalidInput):
                await engine.count(**bad)
        assert recorded.calls == []
        assert len(await engine.list(limit=1000)) == 0 and await engine.count() == 0
        assert recorded.calls == ["list", "count"]


async def test_a_closed_engine_refuses_queries(store_factory: StoreFactory) -> None:
    """list and count on an engine that is not open raise EngineClosed."""
    engine = flowlock.Engine(store_factory())
    with pytest.raises(flowlock.EngineClosed):
        await engine.list()
    with pytest.raises(flowlock.EngineClosed):
        await engine.count()


# -- paging while transitions fire ---------------------------------------------------------------


async def test_paging_while_transitions_fire(engine: flowlock.Engine) -> None:
    """Walks that read a page only after the firing task has applied more transitions (open
    <-> closed on most tickets, new tickets created) end, never return an instance twice, keep
    id order, and return every ticket that matched the whole time exactly once: all of them
    without a state filter, the untouched open ones with state="open". The checker then holds
    every ticket's history to the transitions applied."""
    rng = random.Random(7)
    steady = [f"t{n:03d}s" for n in range(0, 60, 6)]  # never fired at: open throughout
    moving = [f"t{n:03d}m" for n in range(60) if n % 6]
    for iid in sorted(steady + moving):
        await engine.create("ticket", instance_id=iid)
    applied: dict[str, int] = dict.fromkeys(steady + moving, 0)
    progress = asyncio.Condition()
    fired = 0
    stop = asyncio.Event()

    async def fire_forever() -> None:
        nonlocal fired
        for n in itertools.count():
            if stop.is_set():
                return
            if n % 10 == 9:  # a new ticket, somewhere among the ids already walked or not
                iid = f"t{rng.randrange(60):03d}n{n}"
                await engine.create("ticket", instance_id=iid)
                applied[iid] = 0
            else:
                iid = rng.choice(moving)
                state = (await engine.get(iid)).state
                out = await engine.fire(iid, "close" if state == "open" else "reopen")
                applied[iid] += out.applied
            async with progress:
                fired += 1
                progress.notify_all()

    async def after_more_writes(seen: int) -> int:
        """Wait (bounded) until the firing task has done three more writes."""
        async with progress:
            await asyncio.wait_for(progress.wait_for(lambda: fired >= seen + 3), 60)
            return fired

    async def paced_walk(**filters: Any) -> list[str]:
        seen = await after_more_writes(fired)
        page = await engine.list("ticket", limit=4, **filters)
        walked = [i.id for i in page]
        while page.next_cursor is not None:
            assert len(walked) < 10_000, "the walk does not end"
            seen = await after_more_writes(seen)
            page = await engine.list("ticket", limit=4, after=page.next_cursor, **filters)
            walked.extend(i.id for i in page)
        return walked

    firing = asyncio.create_task(fire_forever())
    try:
        everything = await paced_walk()
        open_ones = await paced_walk(state="open")
        open_or_closed = await paced_walk(state=["closed", "open"])
    finally:
        stop.set()
        await firing
    assert fired >= 3 * 30  # the writes really did interleave with every page of the walks

    for walked in (everything, open_ones, open_or_closed):
        assert walked == sorted(set(walked)), "out of order or returned twice"
        assert set(walked) <= set(applied)
    assert set(steady + moving) <= set(everything)
    assert set(steady + moving) <= set(open_or_closed)
    assert set(steady) <= set(open_ones)

    finals = {iid: await engine.get(iid) for iid in applied}
    verdict = check_many(
        [(finals[iid], await engine.history(iid)) for iid in applied],
        initial_state="open",
        expected_applied=applied,
    )
    assert verdict.ok, verdict.violations
    assert await engine.count("ticket") == len(applied)
    assert await engine.count("ticket", ["open", "closed"]) == len(applied)
