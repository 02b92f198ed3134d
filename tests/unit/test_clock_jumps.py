"""A wall clock changed by an hour either way never expires or extends a lease, a wait or an
escalation: every deadline is on the monotonic clock (injected here), and the wall clock is
never read for one.

:class:`WallClock` stands in for ``time.time`` (through the test's monkeypatch) and jumps by an
hour on demand; it also records every read of the wall clock made from flowlock's own code, so
the tests prove that nothing there reads it, not only that a jump changes nothing.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import flowlock
from flowlock import examples
from flowlock.core.errors import LockBusy, LockLost, LockNotOwned
from flowlock.locks import MemoryLocks
from flowlock.stores import MemoryStore
from flowlock.stores.memory import MemoryBoard
from flowlock.strategies.monitor import ConflictMonitor, EscalationSync
from lock_probes import Monotonic, Ticks, WallClock, wait_until

HOUR = 3600.0


@pytest.mark.parametrize("jump", [HOUR, -HOUR], ids=["forward", "back"])
async def test_a_wall_clock_jump_neither_expires_nor_extends_a_memory_lease(
    wall: WallClock, jump: float
) -> None:
    """A lease of 10 s, the wall clock moved an hour: the lease is still held (another caller
    is refused, the holder's check passes, its deadline is unchanged); once 10 s have passed on
    the monotonic clock it is over (another caller takes the key, the holder's check raises
    LockLost), not an hour earlier or later."""
    mono = Monotonic()
    locks = MemoryLocks(clock=mono)
    lease = await locks.acquire("k", ttl=10)
    before = lease.remaining(mono())
    wall.jump(jump)
    assert lease.remaining(mono()) == pytest.approx(before, abs=0.5)
    with pytest.raises(LockBusy):
        await locks.acquire("k", ttl=10)
    assert await locks.owned(lease)
    lease = await locks.extend(lease)  # an extend counts from now on the monotonic clock
    assert lease.remaining(mono()) == pytest.approx(10, abs=0.5)
    wall.jump(-jump)  # and back again
    mono.moved += 10.5
    assert not await locks.owned(lease)
    taken = await locks.acquire("k", ttl=10, wait=0)
    assert taken.fencing == lease.fencing + 1
    with pytest.raises(LockNotOwned):
        await locks.release(lease)


@pytest.mark.parametrize("jump", [HOUR, -HOUR], ids=["forward", "back"])
async def test_a_held_lease_is_lost_at_its_monotonic_deadline_only(
    wall: WallClock, jump: float
) -> None:
    """A Held lease whose wall clock jumps stays held; it is lost when its ttl has run out on
    the monotonic clock (moved past it between two renewals), whatever the wall clock says, and
    its release then says so."""
    mono = Monotonic()
    locks = MemoryLocks(clock=mono)
    holding = locks.acquire("k", ttl=5)
    held = await holding.__aenter__()
    wall.jump(jump)
    held.check()
    assert held.lost is None
    mono.moved += 4.0
    held.check()
    mono.moved += 1.5
    with pytest.raises(LockLost, match="ttl ran out on the local clock"):
        held.check()
    wall.jump(-jump)
    with pytest.raises(LockLost):
        held.check()
    with pytest.raises(LockNotOwned):
        await holding.__aexit__(None, None, None)


async def test_a_renewed_lease_outlives_wall_clock_jumps(
    wall: WallClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease renewed by its watchdog while the wall clock jumps back and forth by an hour:
    the watchdog sleeps ttl/3 between renewals, each renewal counts its ttl from now on the
    monotonic clock, and a full ttl later (on that clock) the lease is still held and is
    released at the end. The watchdog's sleeps and the monotonic clock are the test's."""
    ticks = Ticks.install(monkeypatch)
    mono = Monotonic()
    locks = MemoryLocks(clock=mono)
    ttl = 30.0
    async with locks.acquire("k", ttl=ttl) as held:
        for round_no, jump in enumerate((HOUR, -2 * HOUR, HOUR), start=1):
            wall.jump(jump)
            mono.moved += ttl / 3
            before = held.lease.expires_at
            ticks.tick()  # the watchdog's sleep before this renewal ends

            def renewed(before: float = before) -> bool:
                return held.lease.expires_at > before

            await wait_until(renewed, what=f"renewal {round_no}")
            held.check()
            assert held.lease.remaining(mono()) == pytest.approx(ttl, abs=1.0)
        # A whole ttl has passed on the monotonic clock: without the renewals it would be over.
        assert await locks.owned(held.lease)
        assert ticks.delays == [ttl / 3] * 4  # three renewals, and the fourth sleep begun
    assert not await locks.locked("k")


@pytest.mark.parametrize("jump", [HOUR, -HOUR], ids=["forward", "back"])
async def test_a_wait_for_a_lock_is_bounded_on_the_monotonic_clock(
    wall: WallClock, jump: float
) -> None:
    """A caller waiting for a held key gives up after its wait, however the wall clock moves
    meanwhile."""
    locks = MemoryLocks()
    await locks.acquire("k", ttl=30)

    async def jump_soon() -> None:
        await asyncio.sleep(0.05)
        wall.jump(jump)

    jumper = asyncio.create_task(jump_soon())
    started = time.monotonic()
    with pytest.raises(flowlock.LockTimeout):
        await locks.acquire("k", ttl=1, wait=0.3)
    took = time.monotonic() - started
    await jumper
    # A bound on a wait: tightly from below (the jump cut nothing short), generously above.
    assert 0.3 <= took < 5.3


@pytest.mark.parametrize("jump", [HOUR, -HOUR], ids=["forward", "back"])
async def test_a_wall_clock_jump_neither_ends_nor_extends_a_shared_escalation(
    wall: WallClock, jump: float
) -> None:
    """Two engines' monitors share an escalation through a board; one host's wall clock jumps
    by an hour. The escalation is adopted by the other, stays for the cool-down on both and
    ends after it on both (on the monotonic clock), not an hour early or late."""
    mono = Monotonic()
    board = MemoryBoard(clock=mono)
    a = ConflictMonitor(min_samples=2, cooldown=5.0, clock=mono)
    b = ConflictMonitor(min_samples=2, cooldown=5.0, clock=mono)
    sync_a, sync_b = EscalationSync(board, a), EscalationSync(board, b)
    for _ in range(3):
        a.record("k", conflict=True)
    assert a.escalated("k") is not None
    wall.jump(jump)
    await sync_a.tick()
    await sync_b.tick()
    assert b.escalated("k") is not None
    mono.moved += 4.5
    await sync_a.tick()
    await sync_b.tick()
    assert a.escalated("k") is not None and b.escalated("k") is not None
    mono.moved += 1.0
    await sync_a.tick()
    await sync_b.tick()
    assert a.escalated("k") is None and b.escalated("k") is None
    assert await board.active(await board.now()) == []


async def test_the_engine_reads_no_wall_clock_for_any_deadline(wall: WallClock) -> None:
    """Every strategy (optimistic, pessimistic, distributed, adaptive with its escalation
    sync) runs a hot instance while the wall clock jumps back and forth by an hour: every
    signature lands exactly once, and no flowlock module read the wall clock (the fixture
    checks; the stores' timestamps are data, read with datetime, not deadlines)."""
    store = MemoryStore()
    monitor = ConflictMonitor(min_samples=5, cooldown=0.5)
    async with flowlock.Engine(
        store, locks=MemoryLocks(), monitor=monitor, escalation_sync=0.05
    ) as engine:
        await engine.register(examples.countersign(10_000))
        await engine.create("countersign", instance_id="hot")
        strategies = ["optimistic", "pessimistic", "distributed", "adaptive"]

        async def sign(i: int) -> flowlock.Outcome:
            if i % 10 == 0:
                wall.jump(HOUR if i % 20 == 0 else -HOUR)
            return await engine.fire(
                "hot", "sign", actor=f"a{i}", request_id=f"r{i}", strategy=strategies[i % 4]
            )

        outs = await asyncio.gather(*(sign(i) for i in range(200)), return_exceptions=True)
        applied = [o for o in outs if isinstance(o, flowlock.Outcome) and o.applied]
        failed = [o for o in outs if not isinstance(o, flowlock.Outcome)]
        assert all(isinstance(e, flowlock.ConcurrencyError) for e in failed), failed
        await asyncio.sleep(0.2)  # a few sync ticks, with the wall clock an hour off
        history = await engine.history("hot")
        verdict = flowlock.checker.check(
            await engine.get("hot"), history, expected_applied=len(applied)
        )
        assert verdict.ok, verdict.violations
