"""Load for the failover tests: signer tasks firing ``sign`` on a few countersign documents through
one engine, each signature with a request id of its own, retried with that same request id after
every typed, retryable failure until it has an answer (or a bound passes, which fails the test).

:class:`Load` records what a test asserts on afterwards: every acknowledged signature (applied,
or answered idempotently by a retry), when each call succeeded, and every error on the way.
:func:`unavailability` turns the success times into the figure the docs quote: the longest time
without a successful call around a fault.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import flowlock
from flowlock.checker import check

__all__ = [
    "RETRYABLE",
    "Load",
    "unavailability",
]

# What a caller may see while the primary moves: a lost session (nothing written, or maybe
# written), no connection in time, a bounded wait; each safe to retry with the same request id.
RETRYABLE = (
    flowlock.ConnectionLost,
    flowlock.OutcomeUnknown,
    flowlock.StoreBusy,
    flowlock.LockTimeout,
    flowlock.ConflictRetriesExhausted,
)
RETRY_BOUND = 90.0  # seconds one signature may take, retries included, before the test fails
_BACKOFF_FIRST = 0.02
_BACKOFF_CAP = 0.5  # as a real client's: no hammering a cluster that has no primary yet


@dataclass
class Load:
    """Signers on ``docs`` (countersign instances) through ``engine``, half of them optimistic,
    half pessimistic, until :meth:`stop`."""

    engine: flowlock.Engine
    docs: Sequence[str]
    signers: int = 12
    acked: dict[str, str] = field(default_factory=dict)  # actor -> doc, answered with an Outcome
    replayed: set[str] = field(default_factory=set)  # actors a retry found applied already
    successes: list[float] = field(default_factory=list)  # monotonic time of each Outcome
    errors: list[BaseException] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._signer(i)) for i in range(self.signers)]

    async def stop(self) -> None:
        """Let every signer finish the signature in hand, then return (or raise the first
        signer's failure)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def cancel(self) -> None:
        """Stop at once (a test that failed midway)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def acks_since(self, moment: float) -> int:
        return sum(1 for t in self.successes if t >= moment)

    async def _signer(self, n: int) -> None:
        rng = random.Random(n)
        strategy = "optimistic" if n % 2 else "pessimistic"
        for i in itertools.count():
            if self._stop.is_set():
                return
            doc = self.docs[(n + i) % len(self.docs)]
            actor = f"w{n}-{i}"
            await self._settle(doc, actor, strategy, rng)
            self.acked[actor] = doc

    async def _settle(self, doc: str, actor: str, strategy: str, rng: random.Random) -> None:
        """``actor``'s signature until it has an answer; a typed failure is retried with the
        same request id (what makes the retry safe), backing off as a real client would."""
        deadline = time.monotonic() + RETRY_BOUND
        for attempt in itertools.count():
            try:
                outcome = await self.engine.fire(
                    doc, "sign", actor=actor, request_id=f"req-{actor}", strategy=strategy
                )
            except RETRYABLE as exc:
                self.errors.append(exc)
                if time.monotonic() > deadline:
                    raise AssertionError(f"{actor} got no answer in {RETRY_BOUND:.0f} s") from exc
                pause = min(_BACKOFF_CAP, _BACKOFF_FIRST * 2**attempt)
                await asyncio.sleep(pause * rng.uniform(0.5, 1.0))
                continue
            self.successes.append(time.monotonic())
            if not outcome.applied:
                # Only a retry may find its own request applied (an OutcomeUnknown that had
                # committed); a first attempt never does.
                assert attempt > 0 and outcome.idempotent, (actor, outcome)
                self.replayed.add(actor)
            return

    async def histories(self) -> dict[str, list[flowlock.HistoryEntry]]:
        return {doc: await self.engine.history(doc) for doc in self.docs}

    async def verify(self, *, lossless: bool = True) -> set[str]:
        """The checker over every document (versions contiguous, no request applied twice, each
        row starting where the last ended, the instance what its history says) and no signature
        that no call was answered for. ``lossless``: every acknowledged signature is there, once
        (also counted by the checker as ``expected_applied``). Returns the acknowledged
        signatures that are missing (always empty when ``lossless``)."""
        missing: set[str] = set()
        for doc, history in (await self.histories()).items():
            final = await self.engine.get(doc)
            acked = {actor for actor, d in self.acked.items() if d == doc}
            signed = final.data.get("signers", [])
            assert len(signed) == len(set(signed)), f"{doc}: a signature applied twice"
            # Every signer finishes the signature in hand before it stops: all were answered.
            assert set(signed) <= acked, f"{doc}: a signature nobody was answered for"
            missing |= acked - set(signed)
            expected = len(acked) if lossless else None
            verdict = check(final, history, initial_state="pending", expected_applied=expected)
            assert verdict.ok, verdict.violations
        if lossless:
            assert not missing, f"acknowledged signatures lost: {sorted(missing)}"
        return missing


def unavailability(successes: Sequence[float], since: float) -> float:
    """The longest time without a successful call from the last success before ``since`` (a
    fault began then) to the last success recorded: the unavailability window a fault caused,
    in seconds. Success times are monotonic clock readings, in any order."""
    ordered = sorted(successes)
    before = [t for t in ordered if t < since]
    after = [t for t in ordered if t >= since]
    if not after:
        raise ValueError("no call succeeded after the fault")
    points = [before[-1] if before else since, *after]
    return max(b - a for a, b in itertools.pairwise(points))
