"""One outbox contract for every store (memory, SQLite, PostgreSQL: the ``store_factory``
fixture is parametrised; a store that keeps no outbox yet is skipped, saying so, and runs as
soon as it is an ``OutboxStore``).

A commit writes its entries' messages in its own transaction (a lost compare-and-swap, or a
plan that raised, writes none); the dispatcher's questions (claim, finish, fail, release) and
the operator's (retry, drop, find, count, purge) are asked of the store directly, with no
handler registered, so nothing is delivered behind the tests' backs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import pytest

import flowlock
from flowlock.core.errors import InvalidInput
from flowlock.core.models import HistoryEntry, Snapshot
from flowlock.core.outbox import Emit, Message
from flowlock.locks import MemoryLocks
from flowlock.stores import Store
from flowlock.stores.base import OutboxStore, RowLock
from lock_probes import wait_until
from outbox_store_kit import BOUND, TRACE, WF, emitting, order

StoreFactory = Callable[..., Store]
KINDS = {"reserve": 100, "notify": 100, "charge": 100}


def outbox_store(store: Store) -> OutboxStore:
    """`store` as an OutboxStore, or the test skipped."""
    if not isinstance(store, OutboxStore):
        pytest.skip(
            f"{type(store).__name__} keeps no outbox yet: its OutboxStore methods (claim_messages "
            "and the rest) are not implemented"
        )
    return store


@pytest.fixture
async def engine(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """An open engine with the order workflow and no handler (nothing is delivered)."""
    store = store_factory()
    outbox_store(store)
    async with flowlock.Engine(store, locks=MemoryLocks(), timers=False) as eng:
        await eng.register(order())
        yield eng


def outbox_of(engine: flowlock.Engine) -> OutboxStore:
    return outbox_store(engine.store)


def keys(messages: list[Message]) -> list[str]:
    return [m.key for m in messages]


async def reserved(engine: flowlock.Engine, *ids: str) -> None:
    """Create each instance and reserve it: two messages each (reserve, notify) at version 2."""
    for iid in ids:
        await engine.create(WF, instance_id=iid)
        assert (await engine.fire(iid, "reserve", actor="alice")).applied


async def claim(
    store: OutboxStore,
    kinds: dict[str, int] | None = None,
    *,
    owner: str = "me",
    lease: float = 30,
    run: int = 1,
) -> list[Message]:
    return await store.claim_messages(kinds or KINDS, lease=lease, owner=owner, run=run)


async def backlog(engine: flowlock.Engine, iid: str, kinds: list[str]) -> list[str]:
    """Create `iid` and commit one entry emitting a message of each of `kinds`, in order (keys
    <iid>:2:0, <iid>:2:1, ...); their keys."""
    made = await engine.create(WF, instance_id=iid)
    emits = [Emit(kind, {"i": i}) for i, kind in enumerate(kinds)]
    await engine.store.commit([emitting(made, "x", emits)])
    return [f"{iid}:2:{i}" for i in range(len(kinds))]


async def free_again(store: OutboxStore, kinds: list[str]) -> None:
    """Wait until a message of `kinds` can be claimed, as the store's own clock says."""

    async def due() -> bool:
        return await store.next_message_due(kinds) == 0.0

    await wait_until(due, within=BOUND, what="a message of the kinds is due")


# -- what a commit writes ---------------------------------------------------------------------


async def test_a_transition_writes_its_messages_in_order_under_their_keys(
    engine: flowlock.Engine,
) -> None:
    """An emit function's messages and a Step's are written by the commit: keyed
    <instance>:<version>:<n>, pending, due now, attempts 0, the instance's workflow, the payload
    as JSON, listed by messages() in (version, n) order; a transition that emits nothing writes
    none."""
    store = outbox_of(engine)
    await engine.create(WF, instance_id="a")
    await engine.fire("a", "touch")
    assert await store.messages("a") == []
    await engine.fire("a", "reserve", actor="bob")
    await engine.fire("a", "note")
    found = await store.messages("a")
    assert keys(found) == ["a:3:0", "a:3:1", "a:4:0"]
    assert [(m.kind, m.version, m.n) for m in found] == [
        ("reserve", 3, 0),
        ("notify", 3, 1),
        ("notify", 4, 0),
    ]
    assert [dict(m.payload) for m in found] == [
        {"order": "a", "version": 3},
        {"to": "bob"},
        {"n": 1},
    ]
    for m in found:
        assert (m.instance_id, m.workflow, m.status, m.attempts) == ("a", WF, "pending", 0)
        assert (m.last_error, m.done_at, m.claimed_until, m.fencing_token) == (None,) * 4
        assert m.created_at is not None and m.next_attempt_at is not None
    assert await store.messages("nobody") == []
    got = await store.get_message("a:3:1")
    # The memory store shows its monotonic due time on the wall clock, read anew each time.
    assert got is not None
    assert dataclasses.replace(got, next_attempt_at=None) == dataclasses.replace(
        found[1], next_attempt_at=None
    )
    assert await store.get_message("a:9:0") is None


async def test_a_commit_carries_the_entrys_fencing_token_and_trace(
    engine: flowlock.Engine,
) -> None:
    """Each message carries the fencing token and the trace of the entry that emitted it; a
    batch of several entries writes each entry's messages under its own version."""
    store = outbox_of(engine)
    made = await engine.create(WF, instance_id="a")
    batch = [
        emitting(
            made, "x", [Emit("notify", {"i": 0}), Emit("charge")], fencing_token=7, trace=TRACE
        ),
        emitting(made, "y", [], offset=2, fencing_token=8),
        emitting(made, "z", [Emit("notify", {"i": 2})], offset=3, fencing_token=9),
    ]
    moved = await engine.store.commit(batch)
    assert moved is not None and moved.version == 4
    found = await store.messages("a")
    assert [(m.key, m.fencing_token, m.trace) for m in found] == [
        ("a:2:0", 7, TRACE),
        ("a:2:1", 7, TRACE),
        ("a:4:0", 9, None),
    ]
    assert dict(found[0].payload) == {"i": 0} and dict(found[1].payload) == {}


async def test_the_distributed_strategy_stamps_its_lease_token(engine: flowlock.Engine) -> None:
    """A transition applied under a lease writes its messages with that lease's fencing token
    (the same as its history row's)."""
    store = outbox_of(engine)
    await engine.create(WF, instance_id="a")
    await engine.fire("a", "reserve", strategy="distributed")
    [row] = await engine.history("a")
    assert row.fencing_token is not None
    assert {m.fencing_token for m in await store.messages("a")} == {row.fencing_token}


async def test_a_lost_compare_and_swap_writes_no_message(engine: flowlock.Engine) -> None:
    """A commit whose version compare fails writes none of its messages; in a commit_many the
    loser writes none and the winner writes its own."""
    store = outbox_of(engine)
    a = await engine.create(WF, instance_id="a")
    b = await engine.create(WF, instance_id="b")
    await engine.fire("a", "touch")  # version 2: an entry built on version 1 loses
    assert await engine.store.commit([emitting(a, "x", [Emit("notify")])]) is None
    answers = await engine.store.commit_many(
        [[emitting(a, "x", [Emit("notify")])], [emitting(b, "y", [Emit("charge")])]]
    )
    assert answers[0] is None and answers[1] is not None
    assert await store.messages("a") == []
    assert keys(await store.messages("b")) == ["b:2:0"]


async def test_a_plan_that_raises_writes_no_message(engine: flowlock.Engine) -> None:
    """apply_locked whose plan raises rolls back: no message; a plan returning entries that
    emit writes their messages."""
    store = outbox_of(engine)
    made = await engine.create(WF, instance_id="a")

    def failing(snap: Snapshot) -> list[HistoryEntry]:
        raise InvalidInput(f"the plan of {made.id!r} refuses")

    def planned(snap: Snapshot) -> list[HistoryEntry]:
        return [emitting(snap.instance, "x", [Emit("notify")])]

    with pytest.raises(InvalidInput):
        await engine.store.apply_locked("a", (), failing, RowLock())
    assert await store.messages("a") == []
    done = await engine.store.apply_locked("a", (), planned, RowLock())
    assert done.committed is not None
    assert keys(await store.messages("a")) == ["a:2:0"]


async def test_refused_and_repeated_calls_emit_nothing(engine: flowlock.Engine) -> None:
    """A call refused by the workflow, and a repeat of an applied request id (answered
    idempotently), write no message: only the applied transition's are there."""
    store = outbox_of(engine)
    await engine.create(WF, instance_id="a")
    with pytest.raises(flowlock.TransitionNotAllowed):
        await engine.fire("a", "pay")
    first = await engine.fire("a", "reserve", request_id="r1")
    again = await engine.fire("a", "reserve", request_id="r1")
    assert first.applied and again.idempotent
    assert keys(await store.messages("a")) == ["a:2:0", "a:2:1"]


# -- claiming ----------------------------------------------------------------------------------


async def test_a_claim_takes_one_message_per_instance_at_a_time_in_order(
    engine: flowlock.Engine,
) -> None:
    """Messages of one instance are claimed in (version, n) order, one at a time: a later one is
    held back while an earlier one is pending (claimed or not), whatever its kind; done and dead
    ones do not hold it back."""
    store = outbox_of(engine)
    await reserved(engine, "a", "b")
    await engine.fire("a", "note")
    first = await claim(store)
    assert sorted(keys(first)) == ["a:2:0", "b:2:0"]
    assert await claim(store) == []  # the rest wait for the first ones
    assert await store.finish_messages(["a:2:0"]) == 1
    [second] = await claim(store)
    assert second.key == "a:2:1"
    by_key = {m.key: m for m in first}
    assert await store.fail_message(by_key["b:2:0"], "me", "gone", None)  # dead
    assert await store.finish_messages(["a:2:1"]) == 1
    assert sorted(keys(await claim(store))) == ["a:3:0", "b:2:1"]


async def test_a_claimed_message_is_running_with_its_lease(engine: flowlock.Engine) -> None:
    """A claimed message comes back running, its attempts counted up, claimed until about the
    lease from now, with its lag since the commit; it reads as running until then."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1}, lease=60)
    assert (m.key, m.status, m.attempts, m.attempt, m.workflow) == ("a:2:0", "running", 1, 1, WF)
    assert m.claimed_until is not None and m.created_at is not None
    assert 55 <= (m.claimed_until - m.created_at).total_seconds() <= 60 + BOUND
    assert 0 <= m.lag < BOUND
    got = await store.get_message("a:2:0")
    assert got is not None and (got.status, got.attempts) == ("running", 1)
    assert got.claimed_until is not None


async def test_each_kind_has_its_own_limit_oldest_first(engine: flowlock.Engine) -> None:
    """claim_messages takes at most each kind's own limit, the oldest messages first; a kind
    not asked for, or asked for with a limit of 0, gives none."""
    store = outbox_of(engine)
    for i in range(4):
        made = await engine.create(WF, instance_id=f"c{i}")
        await engine.store.commit([emitting(made, "x", [Emit("charge", {"i": i})])])
    for i in range(3):
        made = await engine.create(WF, instance_id=f"n{i}")
        await engine.store.commit([emitting(made, "x", [Emit("notify", {"i": i})])])
    assert await claim(store, {"reserve": 5, "notify": 0}) == []
    got = await claim(store, {"charge": 2, "notify": 1})
    assert sorted(keys(got)) == ["c0:2:0", "c1:2:0", "n0:2:0"]
    got = await claim(store, {"charge": 5, "notify": 5})
    assert sorted(keys(got)) == ["c2:2:0", "c3:2:0", "n1:2:0", "n2:2:0"]
    assert await claim(store) == []


async def test_a_claim_that_ran_out_is_taken_over(engine: flowlock.Engine) -> None:
    """A claim whose lease ran out (its claimer died) is claimable again: another owner takes
    it, attempts counted on; the first owner's late failure or release changes nothing."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [mine] = await claim(store, {"reserve": 1}, owner="one", lease=0.3)
    assert await claim(store, {"reserve": 1}, owner="two") == []
    await free_again(store, ["reserve"])
    [theirs] = await claim(store, {"reserve": 1}, owner="two")
    assert (theirs.key, theirs.attempts) == ("a:2:0", 2)
    assert not await store.fail_message(mine, "one", "late", 1.0)
    await store.release_message(mine, "one")
    got = await store.get_message("a:2:0")
    assert got is not None and (got.status, got.attempts, got.last_error) == ("running", 2, None)
    assert await store.finish_messages(["a:2:0"]) == 1


async def test_a_released_message_is_claimable_at_once(engine: flowlock.Engine) -> None:
    """release_message gives the owner's claim back (attempts kept): the next claim takes it;
    a release by another owner changes nothing."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1}, owner="one")
    await store.release_message(m, "two")
    assert await claim(store, {"reserve": 1}, owner="two") == []
    await store.release_message(m, "one")
    [again] = await claim(store, {"reserve": 1}, owner="two")
    assert (again.key, again.attempts) == ("a:2:0", 2)


# -- runs: an instance's next messages claimed together --------------------------------------


async def test_a_run_takes_a_hot_instances_backlog_in_order_up_to_run(
    engine: flowlock.Engine,
) -> None:
    """With run=5 one claim takes the hot instance's head and the 4 messages behind it, in
    order, each claimed (attempts 1); kinds[kind] still bounds the instances; another claimer
    gets none of the hot instance's while they are pending, and the next claim takes the next
    run once they are done; run=1 takes the head alone."""
    store = outbox_of(engine)
    hot = await backlog(engine, "hot", ["charge"] * 12)
    cold = await backlog(engine, "cold", ["charge"] * 2)
    got = await claim(store, {"charge": 1}, run=5)
    assert keys(got) == hot[:5]
    assert all((m.status, m.attempts) == ("running", 1) for m in got)
    assert keys(await claim(store, {"charge": 5}, owner="other", run=5)) == cold
    assert await claim(store, {"charge": 5}, owner="other", run=5) == []
    assert await store.finish_messages(hot[:5]) == 5
    assert keys(await claim(store, {"charge": 5}, run=5)) == hot[5:10]
    assert await store.finish_messages(hot[5:10]) == 5
    assert keys(await claim(store, {"charge": 5}, run=1)) == hot[10:11]
    assert await store.finish_messages(hot[10:11]) == 1
    assert keys(await claim(store, {"charge": 5}, run=5)) == hot[11:]


async def test_a_run_stops_at_another_kind_a_message_not_due_and_a_held_one(
    engine: flowlock.Engine,
) -> None:
    """A run is contiguous: it ends before the first message behind its head that is of
    another kind, not due yet, or held by a live claim (the rest wait for a later claim)."""
    store = outbox_of(engine)
    a = await backlog(engine, "a", ["charge", "charge", "notify", "charge"])
    assert keys(await claim(store, {"charge": 1, "notify": 1}, run=10)) == a[:2]

    b = await backlog(engine, "b", ["reserve"] * 4)
    first = await claim(store, {"reserve": 1}, run=10)
    assert keys(first) == b
    assert await store.fail_message(first[2], "me", "later", 600.0)  # due in 10 minutes
    for m in (first[3], first[1], first[0]):
        await store.release_message(m, "me", begun=False)
    assert keys(await claim(store, {"reserve": 5}, run=10)) == b[:2]

    c = await backlog(engine, "c", ["audit"] * 3)
    held = await claim(store, {"audit": 1}, owner="one", run=10)
    assert keys(held) == c
    for m in (held[1], held[0]):
        await store.release_message(m, "one", begun=False)
    assert keys(await claim(store, {"audit": 5}, owner="two", run=10)) == c[:2]


async def test_a_claim_given_back_before_its_delivery_began_has_its_attempt_back(
    engine: flowlock.Engine,
) -> None:
    """release_message(begun=False) counts the attempt back down (a message behind a failed
    one must not run out of attempts untried); begun=True keeps it; another owner's release
    changes nothing."""
    store = outbox_of(engine)
    a = await backlog(engine, "a", ["charge"] * 3)
    first = await claim(store, {"charge": 1}, run=3)
    assert [m.attempts for m in first] == [1, 1, 1]
    await store.release_message(first[2], "someone else", begun=False)
    shown = await store.get_message(a[2])
    assert shown is not None and (shown.status, shown.attempts) == ("running", 1)
    await store.release_message(first[2], "me", begun=False)
    await store.release_message(first[1], "me", begun=False)
    assert await store.fail_message(first[0], "me", "boom", 0.0)  # due again at once
    await free_again(store, ["charge"])
    again = await claim(store, {"charge": 1}, run=3)
    assert keys(again) == a
    assert [m.attempts for m in again] == [2, 1, 1]
    await store.release_message(again[2], "me")  # begun: its attempt stays counted
    shown = await store.get_message(a[2])
    assert shown is not None and (shown.status, shown.attempts) == ("pending", 1)


async def test_concurrent_claimers_of_runs_never_share_a_message_and_keep_the_order(
    engine: flowlock.Engine,
) -> None:
    """Four claimers taking runs at once, each finishing what it got before its next claim:
    every message is claimed exactly once, and each instance's messages are claimed in
    (version, n) order (a later one only with, or after, every earlier one)."""
    store = outbox_of(engine)
    made: dict[str, list[str]] = {}
    for i in range(6):
        made[f"i{i}"] = await backlog(engine, f"i{i}", ["charge"] * 20)
    total = sum(map(len, made.values()))
    claimed: list[str] = []

    async def claimer(owner: str) -> None:
        async with asyncio.timeout(BOUND):
            while len(claimed) < total:
                got = await claim(store, {"charge": 2}, owner=owner, run=4)
                claimed.extend(keys(got))  # before the finish: the order of the claims
                if got:
                    assert await store.finish_messages(keys(got)) == len(got)
                else:
                    await asyncio.sleep(0.005)

    await asyncio.gather(*(claimer(f"c{n}") for n in range(4)))
    assert sorted(claimed) == sorted(k for ks in made.values() for k in ks)  # once each
    for iid, ks in made.items():
        assert [k for k in claimed if k.startswith(f"{iid}:")] == ks


async def test_next_message_due_counts_due_times_and_claims(engine: flowlock.Engine) -> None:
    """next_message_due: None with nothing pending of the kinds; 0 when one is due; while the
    only one is claimed, about the time its claim runs out."""
    store = outbox_of(engine)
    assert await store.next_message_due(["reserve"]) is None
    await reserved(engine, "a")
    assert await store.next_message_due(["charge"]) is None
    assert await store.next_message_due(["reserve", "charge"]) == 0.0
    [m] = await claim(store, {"reserve": 1}, lease=60)
    left = await store.next_message_due(["reserve"])
    assert left is not None and 50 < left <= 60
    await store.finish_messages([m.key])
    assert await store.next_message_due(["reserve"]) is None


# -- finishing, failing ------------------------------------------------------------------------


async def test_finish_marks_pending_messages_done_in_one_call(engine: flowlock.Engine) -> None:
    """finish_messages marks every pending message of the keys done (claimed or not, whoever
    holds it) and counts them; a done, dead or unknown key is left as it is."""
    store = outbox_of(engine)
    await reserved(engine, "a", "b")
    [m] = await claim(store, {"reserve": 1})
    assert await store.finish_messages([m.key, "b:2:0", "b:2:1", "zz:1:0"]) == 3
    assert await store.finish_messages([m.key, "b:2:0"]) == 0
    done = await store.get_message(m.key)
    assert done is not None
    assert (done.status, done.claimed_until, done.next_attempt_at) == ("done", None, None)
    assert done.done_at is not None and done.attempts == 1
    assert [x.status for x in await store.messages("a")] == ["done", "pending"]


async def test_a_failed_delivery_is_due_again_later(engine: flowlock.Engine) -> None:
    """fail_message with a delay: pending again, unclaimed, its error kept, not claimable before
    the delay passed (on the store's clock), then claimed as attempt 2."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1})
    assert await store.fail_message(m, "me", "HTTP 503", 0.5)
    got = await store.get_message(m.key)
    assert got is not None
    assert (got.status, got.attempts, got.last_error, got.claimed_until) == (
        "pending",
        1,
        "HTTP 503",
        None,
    )
    assert got.next_attempt_at is not None and got.created_at is not None
    assert got.next_attempt_at > got.created_at
    assert await claim(store, {"reserve": 1}) == []
    left = await store.next_message_due(["reserve"])
    assert left is not None and 0 < left <= 0.5
    assert not await store.fail_message(m, "someone else", "x", None)
    await free_again(store, ["reserve"])
    [again] = await claim(store, {"reserve": 1})
    assert (again.key, again.attempts, again.last_error) == ("a:2:0", 2, "HTTP 503")
    assert not await store.fail_message(m, "me", "stale attempt", None)  # attempt 1 is over


async def test_a_wait_not_counted_gives_its_attempt_back(engine: flowlock.Engine) -> None:
    """fail_message(counted=False), the dispatcher's answer to a Then into a paused instance:
    pending again with its error, its attempt counted back down, so the next claim is the
    same attempt again; only while the claimer still holds it."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1})
    assert m.attempts == 1
    assert await store.fail_message(m, "me", "InstancePaused", 0.0, counted=False)
    got = await store.get_message(m.key)
    assert got is not None
    assert (got.status, got.attempts, got.last_error) == ("pending", 0, "InstancePaused")
    assert not await store.fail_message(m, "me", "stale", 0.0, counted=False)
    await free_again(store, ["reserve"])
    [again] = await claim(store, {"reserve": 1})
    assert (again.key, again.attempts) == (m.key, 1)


async def test_a_delivery_given_up_is_dead_and_holds_nothing_back(
    engine: flowlock.Engine,
) -> None:
    """fail_message without a delay: dead, kept with its error, never claimed again, no longer
    due; the instance's next message goes. A failure of a message already done is refused."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1, "notify": 1})
    assert await store.fail_message(m, "me", "HTTP 400", None)
    dead = await store.get_message(m.key)
    assert dead is not None
    assert (dead.status, dead.last_error, dead.next_attempt_at) == ("dead", "HTTP 400", None)
    assert await store.next_message_due(["reserve"]) is None
    [nxt] = await claim(store, {"reserve": 1, "notify": 1})
    assert nxt.key == "a:2:1"
    await store.finish_messages([nxt.key])
    assert not await store.fail_message(nxt, "me", "after done", None)
    assert (await store.get_message(nxt.key) or nxt).status == "done"


# -- operators: retry, drop, find, count, purge ------------------------------------------------


async def test_retry_makes_a_dead_message_due_now_with_fresh_attempts(
    engine: flowlock.Engine,
) -> None:
    """retry_message: a dead message is pending again, due now, attempts 0, its last error
    kept, and claimable; a done one is returned unchanged; an unknown key is None."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1})
    await store.fail_message(m, "me", "boom", None)
    retried = await store.retry_message(m.key)
    assert retried is not None
    assert (retried.status, retried.attempts, retried.last_error) == ("pending", 0, "boom")
    [again] = await claim(store, {"reserve": 1})
    assert (again.key, again.attempts) == (m.key, 1)
    await store.finish_messages([m.key])
    done = await store.retry_message(m.key)
    assert done is not None and done.status == "done"
    assert await store.retry_message("a:9:9") is None


async def test_retry_leaves_a_message_held_by_a_live_claim_to_its_delivery(
    engine: flowlock.Engine,
) -> None:
    """retry_message of a message a claimer holds (running) changes nothing and returns it
    running: clearing the claim would deliver it twice at once. Its claimer still ends it; and
    the engine refuses the retry with InvalidInput."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store, {"reserve": 1})
    left = await store.retry_message(m.key)
    assert left is not None and (left.status, left.attempts) == ("running", 1)
    with pytest.raises(flowlock.InvalidInput, match="being delivered now"):
        await engine.retry_message(m.key)
    assert await store.fail_message(m, "me", "boom", None)
    retried = await engine.retry_message(m.key)
    assert (retried.status, retried.attempts) == ("pending", 0)


async def test_drop_deletes_a_message_and_lets_the_next_one_go(engine: flowlock.Engine) -> None:
    """drop_message deletes it (True), and the instance's later message becomes claimable;
    dropping it again, or an unknown key, is False."""
    store = outbox_of(engine)
    await reserved(engine, "a")
    [m] = await claim(store)
    assert await store.drop_message(m.key)
    assert not await store.drop_message(m.key)
    assert not await store.drop_message("zz:1:0")
    assert await store.get_message(m.key) is None
    assert keys(await claim(store)) == ["a:2:1"]


async def test_find_messages_filters_and_pages_in_key_order(engine: flowlock.Engine) -> None:
    """find_messages lists messages in key (code point) order after a cursor, of a status and a
    kind when given: running is pending and held, pending is pending and not held."""
    store = outbox_of(engine)
    await reserved(engine, "a", "b", "c")
    everything = await store.find_messages()
    assert keys(everything) == sorted(keys(everything))
    assert len(everything) == 6
    [held] = await claim(store, {"reserve": 1})
    await store.finish_messages(["b:2:0"])
    [ca] = [m for m in await claim(store, {"reserve": 1}) if m.key == "c:2:0"]
    await store.fail_message(ca, "me", "no", None)
    assert keys(await store.find_messages(status="running")) == [held.key]
    assert keys(await store.find_messages(status="done")) == ["b:2:0"]
    assert keys(await store.find_messages(status="dead")) == ["c:2:0"]
    assert keys(await store.find_messages(status="pending")) == ["a:2:1", "b:2:1", "c:2:1"]
    assert keys(await store.find_messages(kind="reserve")) == ["a:2:0", "b:2:0", "c:2:0"]
    assert keys(await store.find_messages(kind="notify", status="pending")) == [
        "a:2:1",
        "b:2:1",
        "c:2:1",
    ]
    pages: list[str] = []
    after: str | None = None
    while page := await store.find_messages(after=after, limit=4):
        pages += keys(page)
        after = page[-1].key
    assert pages == keys(everything)
    assert await store.find_messages(kind="charge") == []


async def test_find_messages_lists_in_message_order(engine: flowlock.Engine) -> None:
    """Messages are listed by instance id in code point order (upper case before lower case),
    whatever the database's collation, then by version as a number ("a:2:0" before "a:10:0"),
    then by place; a key is a cursor, and so is an instance id (after all its messages)."""
    store = outbox_of(engine)
    for iid in ("b", "B", "a"):
        made = await engine.create(WF, instance_id=iid)
        await engine.store.commit([emitting(made, "x", [Emit("notify")])])
    a = await engine.get("a")
    await engine.store.commit([emitting(a, "x", [Emit("notify")], offset=i) for i in range(1, 10)])
    listed = keys(await store.find_messages(limit=100))
    assert listed == ["B:2:0", *(f"a:{v}:0" for v in range(2, 12)), "b:2:0"]
    assert keys(await store.find_messages(after="a:9:0", limit=3)) == ["a:10:0", "a:11:0", "b:2:0"]
    assert keys(await store.find_messages(after="a", limit=100)) == ["b:2:0"]


async def test_counts_per_status(engine: flowlock.Engine) -> None:
    """count_messages gives every status, zeros included: pending, running, done, dead."""
    store = outbox_of(engine)
    assert dict(await store.count_messages()) == {"pending": 0, "running": 0, "done": 0, "dead": 0}
    await reserved(engine, "a", "b", "c")
    [ma, mb, mc] = sorted(await claim(store, {"reserve": 3}), key=lambda m: m.key)
    await store.finish_messages([ma.key])
    await store.fail_message(mb, "me", "x", None)
    assert dict(await store.count_messages()) == {"pending": 3, "running": 1, "done": 1, "dead": 1}
    assert mc.status == "running"


async def test_purge_deletes_old_done_messages_oldest_first(engine: flowlock.Engine) -> None:
    """purge_messages deletes at most `limit` done messages done more than `older_than`
    seconds ago, oldest first, and counts them; pending and dead ones stay."""
    store = outbox_of(engine)
    await reserved(engine, "a", "b", "c")
    for iid in ("b", "a", "c"):  # done in this order
        await store.finish_messages([f"{iid}:2:0"])
        await asyncio.sleep(0.01)
    [dead] = await claim(store, {"notify": 1})
    await store.fail_message(dead, "me", "x", None)
    assert await store.purge_messages(3600, 10) == 0
    assert await store.purge_messages(0, 2) == 2
    assert keys(await store.find_messages(status="done")) == ["c:2:0"]
    assert await store.purge_messages(0, 2) == 1
    assert await store.purge_messages(0, 2) == 0
    counts = dict(await store.count_messages())
    assert (counts["done"], counts["dead"], counts["pending"] + counts["running"]) == (0, 1, 2)


# -- waking the dispatcher ---------------------------------------------------------------------


async def test_pending_is_set_by_a_commit_that_writes_a_message(engine: flowlock.Engine) -> None:
    """pending() yields an event that a commit writing a message sets (PostgreSQL: by NOTIFY,
    once the LISTEN is up, which sets it too)."""
    store = outbox_of(engine)
    await engine.create(WF, instance_id="a")
    async with store.pending() as event:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), 1.0)  # LISTEN up, where there is one
        event.clear()
        await engine.fire("a", "reserve")
        async with asyncio.timeout(BOUND):
            await event.wait()
