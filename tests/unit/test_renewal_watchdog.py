"""The lease watchdog (``flowlock.locks.base.Held``) treats any exception from ``extend`` as a
failed renewal: a backend that let an untranslated error through (not a flowlock error) does not
end the renewals silently. The renewals are retried until the lease's deadline, and then the
lease is marked lost, logged, and ``check()`` raises LockLost saying why.

The watchdog's sleeps and the clock are the test's: it renews when the test says so, and the
deadline passes when the test moves the clock. No server needed.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from flowlock.core.errors import LockLost, LockNotOwned
from flowlock.locks import Lease, MemoryLocks
from lock_probes import Ticks, wait_until

TTL = 30.0


class Clock:
    """A monotonic clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class UntranslatedExtend(MemoryLocks):
    """Memory locks whose ``extend`` fails with an error that is not a flowlock error, as a
    backend's driver error that escaped its translation would (asyncpg's InternalClientError
    did)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.extends = 0

    async def extend(self, lease: Lease, ttl: float | None = None) -> Lease:
        self.extends += 1
        raise RuntimeError("cannot switch to state 15; another operation (2) is in progress")


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Ticks:
    return Ticks.install(monkeypatch)


async def test_an_untranslated_extend_error_marks_the_lease_lost_at_its_deadline(
    ticks: Ticks, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewals that raise a non-flowlock error are retried (logged at WARNING) while the lease
    has time left, and the lease is not counted lost before its deadline; at the deadline the
    watchdog marks it lost, logs it once, and check() raises LockLost naming the error."""
    clock = Clock()
    locks = UntranslatedExtend(clock)
    caplog.set_level(logging.WARNING, logger="flowlock")
    context = locks.acquire("k", ttl=TTL)
    held = await context.__aenter__()
    deadline = held.lease.expires_at
    for attempt in range(1, 4):
        ticks.tick()  # the sleep before a renewal, or the pause after a failed one
        ticks.tick()

        def renewed(n: int = attempt) -> bool:
            return locks.extends >= n

        await wait_until(renewed, what=f"renewal {attempt}")
        assert held.lost is None  # failed renewals, but the lease has time left
        held.check()
    retried = [r for r in caplog.records if "failed, retrying" in r.getMessage()]
    assert retried and all("RuntimeError" in r.getMessage() for r in retried)

    clock.now = deadline + 0.001
    for _ in range(3):
        ticks.tick()

    def marked() -> bool:
        return any("lost the lease" in r.getMessage() for r in caplog.records)

    await wait_until(marked, what="the watchdog marking the lease lost")
    with pytest.raises(LockLost) as caught:
        held.check()
    assert "renewals failed until the ttl ran out" in str(caught.value)
    assert "RuntimeError" in str(caught.value)
    assert len([r for r in caplog.records if "lost the lease" in r.getMessage()]) == 1
    extends = locks.extends
    for _ in range(3):
        ticks.tick()
    await asyncio.sleep(0)
    assert locks.extends == extends  # the watchdog has stopped: a lost lease is not renewed
    # The lease ran out (on the memory backend's clock too): its release says so.
    with pytest.raises(LockNotOwned):
        await context.__aexit__(None, None, None)
