"""Worker processes for the multi-process scenarios, and the messages they exchange.

Each message is a dataclass with `to_dict` and `from_dict` for the JSON-lines wire.
docs/benchmarks.md lists the requests and replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from flowlock.bench.config import Target
from flowlock.bench.results import CallResult, CallSpec, Params
from flowlock.core.errors import FlowlockError

__all__ = [
    "Arm",
    "ArmedReply",
    "Close",
    "Closed",
    "Done",
    "Failed",
    "Go",
    "Open",
    "Opened",
    "Reply",
    "Request",
    "WorkerPool",
    "reply_from_dict",
    "request_from_dict",
]

_WORKER_TIMEOUT = 600.0
_LINE_LIMIT = 64 * 1024 * 1024  # a round's results for thousands of calls fit on one line


# -- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Open a fresh session for `strategy` on `scenario`.

    It gets its own pool of `pool_size`, engine and lock backend, as in-process.
    The engine batches unless `batching` is False.
    """

    op: ClassVar[str] = "open"
    target: Target
    pool_size: int
    scenario: str
    strategy: str
    params: Params
    seed: str
    batching: bool = True
    timers: bool = True
    """Whether the session's engine runs its timer service (`Engine(timers=...)`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "target": self.target.to_json(),
            "pool_size": self.pool_size,
            "scenario": self.scenario,
            "strategy": self.strategy,
            "params": {
                "workers": self.params.workers,
                "ops": self.params.ops,
                "processes": self.params.processes,
            },
            "seed": self.seed,
            "batching": self.batching,
            "timers": self.timers,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Open:
        return cls(
            target=Target.from_json(doc["target"]),
            pool_size=int(doc["pool_size"]),
            scenario=doc["scenario"],
            strategy=doc["strategy"],
            params=Params(**doc["params"]),
            seed=doc["seed"],
            batching=bool(doc["batching"]),
            timers=bool(doc.get("timers", True)),
        )


@dataclass(frozen=True, slots=True)
class Arm:
    """Create one caller task per lane, parked on the start gate."""

    op: ClassVar[str] = "arm"
    lanes: tuple[tuple[CallSpec, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "lanes": [[c.to_json() for c in lane] for lane in self.lanes]}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Arm:
        return cls(tuple(tuple(CallSpec.from_json(c) for c in lane) for lane in doc["lanes"]))


@dataclass(frozen=True, slots=True)
class Go:
    """Release the armed callers."""

    op: ClassVar[str] = "go"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Go:
        return cls()


@dataclass(frozen=True, slots=True)
class Close:
    """Close the session."""

    op: ClassVar[str] = "close"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Close:
        return cls()


Request = Open | Arm | Go | Close

# -- replies -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Opened:
    op: ClassVar[str] = "opened"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Opened:
        return cls()


@dataclass(frozen=True, slots=True)
class ArmedReply:
    """Every caller of the round waits at the gate."""

    op: ClassVar[str] = "armed"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ArmedReply:
        return cls()


@dataclass(frozen=True, slots=True)
class Done:
    """Every call's result, the seconds to the last answer, the round's lease wait, and the
    CPU seconds the worker process spent on the round.

    Latencies are measured in the worker, from its own release.
    """

    op: ClassVar[str] = "done"
    results: tuple[CallResult, ...]
    wall: float
    lease_wait: float
    cpu: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "results": [r.to_json() for r in self.results],
            "wall": self.wall,
            "lease_wait": self.lease_wait,
            "cpu": self.cpu,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Done:
        return cls(
            tuple(CallResult.from_json(r) for r in doc["results"]),
            float(doc["wall"]),
            float(doc["lease_wait"]),
            float(doc.get("cpu", 0.0)),
        )


@dataclass(frozen=True, slots=True)
class Closed:
    """The session is closed; its engine's escalation and timer counts.

    `escalated`: instances its adaptive monitor escalated while open.
    `adopted`: those of them taken from the board, decided by another engine.
    `fired`: timers its timer service fired (whatever came of each).
    """

    op: ClassVar[str] = "closed"
    escalated: int = 0
    adopted: int = 0
    fired: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "escalated": self.escalated,
            "adopted": self.adopted,
            "fired": self.fired,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Closed:
        return cls(
            int(doc.get("escalated", 0)), int(doc.get("adopted", 0)), int(doc.get("fired", 0))
        )


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed: the exception's type and message."""

    op: ClassVar[str] = "error"
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "message": self.message}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Failed:
        return cls(str(doc.get("message")))


Reply = Opened | ArmedReply | Done | Closed | Failed

_REQUESTS: dict[str, type[Request]] = {t.op: t for t in (Open, Arm, Go, Close)}
_REPLIES: dict[str, type[Reply]] = {t.op: t for t in (Opened, ArmedReply, Done, Closed, Failed)}


def request_from_dict(doc: Mapping[str, Any]) -> Request:
    """The request `doc` encodes; ValueError for an unknown `op`."""
    kind = _REQUESTS.get(str(doc.get("op")))
    if kind is None:
        raise ValueError(f"unknown request {doc.get('op')!r}")
    return kind.from_dict(doc)


def reply_from_dict(doc: Mapping[str, Any]) -> Reply:
    """The reply `doc` encodes; ValueError for an unknown `op`."""
    kind = _REPLIES.get(str(doc.get("op")))
    if kind is None:
        raise ValueError(f"answered {doc.get('op')!r}")
    return kind.from_dict(doc)


# -- the pool ----------------------------------------------------------------------------------

R = TypeVar("R", Opened, ArmedReply, Done, Closed)


WORKER_ARGV = (sys.executable, "-m", "flowlock.bench.worker")
"""How a worker process is started (inside a namespaced host: after `ip netns exec NAME`)."""


class WorkerPool:
    """`count` worker processes speaking JSON lines on stdin and stdout.

    Workers start in their own session, so Ctrl-C reaches only this process.
    This process then closes them: EOF on stdin, and a kill if they do not exit.
    `commands` replaces each worker's command line (namespaced hosts use `ip netns exec`).
    `labels` say where each runs, for error messages.
    """

    def __init__(
        self,
        count: int,
        *,
        commands: Sequence[Sequence[str]] | None = None,
        labels: Sequence[str] | None = None,
    ) -> None:
        self.count = count
        self._commands = [list(c) for c in commands] if commands else [list(WORKER_ARGV)] * count
        self._labels = list(labels) if labels else [""] * count
        if len(self._commands) != count or len(self._labels) != count:
            raise ValueError(f"{count} workers need {count} commands and labels")
        self._procs: list[asyncio.subprocess.Process] = []
        self._stderr: list[deque[str]] = []
        self._drains: list[asyncio.Task[None]] = []

    @property
    def started(self) -> bool:
        return bool(self._procs)

    async def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for argv in self._commands:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=env,
                limit=_LINE_LIMIT,
            )
            self._procs.append(proc)
            tail: deque[str] = deque(maxlen=30)
            self._stderr.append(tail)
            self._drains.append(asyncio.create_task(self._drain(proc, tail)))

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process, tail: deque[str]) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            tail.append(line.decode(errors="replace").rstrip())

    async def send(self, requests: Sequence[Request]) -> None:
        """One request to each of the first `len(requests)` workers, in order."""
        if len(requests) > len(self._procs):
            raise ValueError(f"{len(requests)} requests for {len(self._procs)} workers")
        procs = self._procs[: len(requests)]
        for proc, request in zip(procs, requests, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(request.to_dict()).encode() + b"\n")
        await asyncio.gather(*(p.stdin.drain() for p in procs if p.stdin is not None))

    async def send_all(self, request: Request) -> None:
        """The same request to every worker."""
        await self.send([request] * self.count)

    async def receive(self, expect: type[R], count: int | None = None) -> list[R]:
        """The reply of each of the first `count` workers (default all): each an `expect`."""
        asked = self.count if count is None else count
        return list(await asyncio.gather(*(self._reply(i, expect) for i in range(asked))))

    async def ask(self, requests: Sequence[Request], expect: type[R]) -> list[R]:
        """Send `requests` to the first `len(requests)` workers and wait for their replies."""
        await self.send(requests)
        return await self.receive(expect, len(requests))

    async def _reply(self, index: int, expect: type[R]) -> R:
        proc = self._procs[index]
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), _WORKER_TIMEOUT)
        except TimeoutError:
            raise self._failure(index, f"no answer within {_WORKER_TIMEOUT:.0f} s") from None
        if not line:
            await asyncio.sleep(0.1)  # let the stderr drain catch the last words
            raise self._failure(index, f"exited (code {proc.returncode})")
        try:
            doc = json.loads(line)
        except ValueError:
            raise self._failure(
                index, f"answered a line that is not JSON: {line[:200]!r}"
            ) from None
        try:
            reply = reply_from_dict(doc)
        except ValueError as exc:
            raise self._failure(index, f"{exc}, not {expect.op!r}") from None
        if isinstance(reply, Failed):
            raise self._failure(index, reply.message)
        if not isinstance(reply, expect):
            raise self._failure(index, f"answered {reply.op!r}, not {expect.op!r}")
        return reply

    def _failure(self, index: int, what: str) -> FlowlockError:
        tail = "\n".join(self._stderr[index]) if index < len(self._stderr) else ""
        where = f" ({self._labels[index]})" if self._labels[index] else ""
        return FlowlockError(
            f"bench worker process {index}{where} {what}" + (f"\n{tail}" if tail else "")
        )

    async def aclose(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in self._drains:
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        self._drains.clear()
