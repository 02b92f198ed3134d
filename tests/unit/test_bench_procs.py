"""The benchmark's worker messages and round timing, without any server or process: each message
survives the JSON line it travels as, and the start gate releases and times every caller.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from flowlock.bench.config import Target
from flowlock.bench.measure import Armed, Gate, peak_overlap
from flowlock.bench.procs import (
    Arm,
    ArmedReply,
    Close,
    Closed,
    Done,
    Failed,
    Go,
    Open,
    Opened,
    Reply,
    Request,
    reply_from_dict,
    request_from_dict,
)
from flowlock.bench.results import CallResult, CallSpec, Params
from flowlock.bench.scenarios import Fired, Scenario
from flowlock.core.errors import ConflictRetriesExhausted, GuardRejected
from flowlock.engine import Engine

TARGET = Target("postgresql://h/db", "flowlock_bench_1", "ns", "abcd", 25, None)
CALL = CallSpec("i-1", "step", actor="w0-0", payload={"qty": 1}, request_id="r-1")


def _wire(doc: dict[str, Any]) -> dict[str, Any]:
    """What the other end of the pipe reads back."""
    decoded: dict[str, Any] = json.loads(json.dumps(doc))
    return decoded


@pytest.mark.parametrize(
    "request_",
    [
        Open(TARGET, 7, "cluster", "optimistic", Params(workers=8, ops=3, processes=4), "7/c/o/p0"),
        Open(TARGET, 7, "cluster", "adaptive", Params(), "7/c/a/p1", batching=False),
        Open(TARGET, 7, "deadline", "optimistic", Params(), "7/d/o/p0", timers=False),
        Arm(((CALL,), (CALL, CallSpec("i-2", "step", at=1_700_000_000.25)))),
        Go(),
        Close(),
    ],
)
def test_requests_round_trip(request_: Request) -> None:
    """Every request decodes to an equal dataclass after a trip through JSON."""
    assert request_from_dict(_wire(request_.to_dict())) == request_


@pytest.mark.parametrize(
    "reply",
    [
        Opened(),
        ArmedReply(),
        Done((CallResult(CALL, "failed", 0.012, 3, "LockTimeout", "waited 5 s"),), 0.5, 0.25),
        Done((CallResult(CALL, "applied", 0.004, 1, batch_size=17),), 0.1, 0.0),
        Done((CallResult(CALL, "applied", 0.004, 1),), 0.1, 0.0, cpu=0.0375),
        Closed(),
        Closed(3, 1, fired=64),
        Failed("RuntimeError: arm before open"),
    ],
)
def test_replies_round_trip(reply: Reply) -> None:
    """Every reply decodes to an equal dataclass after a trip through JSON."""
    assert reply_from_dict(_wire(reply.to_dict())) == reply


def test_open_travels_as_the_documented_keys() -> None:
    """The open request carries op, target, pool size, names, the three round parameters (not
    the warm-up flag, which only the parent's setup reads), the seed, and whether the worker's
    engine batches (on unless the run said off) and runs its timer service (on)."""
    doc = Open(TARGET, 7, "cluster", "raw", Params(8, 3, 4, warmup=True), "s").to_dict()
    assert doc == {
        "op": "open",
        "target": TARGET.to_json(),
        "pool_size": 7,
        "scenario": "cluster",
        "strategy": "raw",
        "params": {"workers": 8, "ops": 3, "processes": 4},
        "seed": "s",
        "batching": True,
        "timers": True,
    }
    assert Go().to_dict() == {"op": "go"}
    assert Failed("boom").to_dict() == {"op": "error", "message": "boom"}


def test_unknown_ops_are_refused() -> None:
    """A line with an op nobody knows is a ValueError naming it, both ways."""
    with pytest.raises(ValueError, match="unknown request 'dance'"):
        request_from_dict({"op": "dance"})
    with pytest.raises(ValueError, match="answered 'dance'"):
        reply_from_dict({"op": "dance"})


# -- the sampler's overlap and the start gate ----------------------------------------------------


def test_peak_overlap_counts_simultaneous_statements() -> None:
    """The most intervals open at one instant; touching end to start is not an overlap."""
    assert peak_overlap([]) == 0
    assert peak_overlap([(0.0, 1.0), (0.5, 2.0), (0.9, 1.1), (1.5, 3.0)]) == 3
    assert peak_overlap([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 1


async def test_gate_opens_only_once_everyone_waits_and_released() -> None:
    """ready() returns when every party waits; nobody passes before release()."""
    gate = Gate(2)
    passed: list[int] = []

    async def party(n: int) -> None:
        await gate.wait()
        passed.append(n)

    tasks = [asyncio.create_task(party(n)) for n in range(2)]
    await asyncio.wait_for(gate.ready(), 1)
    await asyncio.sleep(0)
    assert passed == []
    released = gate.release()
    await asyncio.gather(*tasks)
    assert sorted(passed) == [0, 1]
    assert gate.released_at == released > 0


class _FakeSession:
    """Answers each call by its event: apply, already done, refuse, lose, or wait a while."""

    strategy = "fake"

    @property
    def engine(self) -> Engine:
        raise NotImplementedError

    @property
    def pool(self) -> Any:
        raise NotImplementedError

    async def fire(self, call: CallSpec) -> Fired:
        if call.event == "refuse":
            raise GuardRejected("out of stock")
        if call.event == "lose":
            raise ConflictRetriesExhausted(call.instance_id, call.event, 3)
        if call.event == "slow":
            await asyncio.sleep(0.02)
        return Fired("idempotent" if call.event == "done" else "applied", 2, batch_size=3)

    async def run_once(self, job: str, tick: int, fn: Callable[[], Awaitable[None]]) -> bool | None:
        return None


async def test_armed_callers_report_each_outcome_and_time_each_lane() -> None:
    """Released together, each call is answered by kind with its attempts and error class;
    a lane's calls are timed one after another, and the wall time covers the slowest lane."""
    lanes = [
        [CallSpec("i", "apply"), CallSpec("i", "done")],
        [CallSpec("i", "refuse")],
        [CallSpec("i", "lose")],
        [CallSpec("i", "slow")],
    ]
    armed = Armed(Scenario(), _FakeSession(), lanes)
    await asyncio.wait_for(armed.ready(), 1)
    results, wall = await armed.go()
    by_event = {r.call.event: r for r in results}
    assert [r.call.event for r in results] == ["apply", "done", "refuse", "lose", "slow"]
    assert (by_event["apply"].kind, by_event["apply"].attempts) == ("applied", 2)
    assert by_event["done"].kind == "idempotent"
    # The session's batch size travels with the answer; a raised call had no Outcome.
    assert by_event["apply"].batch_size == by_event["done"].batch_size == 3
    refused = by_event["refuse"]
    assert (refused.kind, refused.attempts, refused.error) == ("refused", 1, "GuardRejected")
    lost = by_event["lose"]
    assert (lost.kind, lost.attempts, lost.error) == ("failed", 3, "ConflictRetriesExhausted")
    assert refused.batch_size is None and lost.batch_size is None
    assert by_event["slow"].latency >= 0.02
    assert wall >= by_event["slow"].latency
    assert all(r.latency >= 0 for r in results)
