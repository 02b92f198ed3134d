"""A benchmark worker process: `python -m flowlock.bench.worker`.

The runner drives it with one JSON request a line on stdin; each gets one reply line.
End of input closes everything and exits. docs/benchmarks.md describes the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Callable
from typing import Protocol

from flowlock.bench.host import loop_factory
from flowlock.bench.measure import Armed, cpu_seconds
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
    request_from_dict,
)
from flowlock.bench.registry import STRATEGIES
from flowlock.bench.scenarios import SCENARIOS, Scenario
from flowlock.bench.session import BenchSession, open_session

__all__ = ["Handler", "main", "serve"]


class Handler(Protocol):
    """What answers the runner's requests in a worker process (the lab's HTTP load generator
    is one too)."""

    async def handle(self, request: Request) -> Reply: ...

    async def close(self) -> None: ...


def _reply(message: Reply) -> None:
    sys.stdout.write(json.dumps(message.to_dict()) + "\n")
    sys.stdout.flush()


class _Worker:
    def __init__(self) -> None:
        self._stack: contextlib.AsyncExitStack | None = None
        self._session: BenchSession | None = None
        self._scenario: Scenario | None = None
        self._armed: Armed | None = None

    async def handle(self, request: Request) -> Reply:
        match request:
            case Open():
                return await self._open(request)
            case Arm():
                return await self._arm(request)
            case Go():
                return await self._go()
            case Close():
                return await self._close()

    async def _open(self, request: Open) -> Opened:
        await self.close()
        scenario = SCENARIOS[request.scenario]
        stack = contextlib.AsyncExitStack()
        try:
            self._session = await stack.enter_async_context(
                open_session(
                    STRATEGIES[request.strategy],
                    request.target,
                    scenario,
                    request.params,
                    random.Random(request.seed),
                    pool_size=request.pool_size,
                    batching=request.batching,
                    timers=request.timers,
                )
            )
        except BaseException:
            await stack.aclose()
            raise
        self._stack, self._scenario = stack, scenario
        return Opened()

    async def _arm(self, request: Arm) -> ArmedReply:
        if self._session is None or self._scenario is None:
            raise RuntimeError("arm before open")
        self._armed = Armed(self._scenario, self._session, request.lanes)
        await self._armed.ready()
        return ArmedReply()

    async def _go(self) -> Done:
        if self._armed is None or self._session is None:
            raise RuntimeError("go before arm")
        armed, self._armed = self._armed, None
        leased = self._session.lease_wait
        spent = cpu_seconds()
        results, wall = await armed.go()
        spent = cpu_seconds() - spent
        return Done(tuple(results), wall, self._session.lease_wait - leased, spent)

    async def _close(self) -> Closed:
        """Close the session; its escalation counts (its engine's adaptive monitor, new per
        session) and its timer service's firings, counted once the firings in flight ended."""
        if self._session is None:
            return Closed()
        engine = self._session.engine
        await self.close()
        service = engine.timer_service
        fired = 0 if service is None else service.fired
        return Closed(engine.monitor.escalations, engine.monitor.adopted, fired)

    async def close(self) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            await armed.cancel()
        stack, self._stack = self._stack, None
        self._session = self._scenario = None
        if stack is not None:
            await stack.aclose()


async def _lines() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _answer(worker: Handler, line: bytes) -> Reply:
    return await worker.handle(request_from_dict(json.loads(line)))


async def _serve(make: Callable[[], Handler]) -> None:
    worker = make()
    reader = await _lines()
    try:
        while line := await reader.readline():
            request = asyncio.create_task(_answer(worker, line))
            # Why watch stdin while a request runs: the runner closes the pipe to stop us
            # (an error elsewhere, Ctrl-C); a round of many calls must not run to its end first.
            eof = asyncio.create_task(_at_eof(reader))
            await asyncio.wait({request, eof}, return_when=asyncio.FIRST_COMPLETED)
            if not request.done():
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
                return
            eof.cancel()
            await asyncio.gather(eof, return_exceptions=True)
            try:
                answer = request.result()
            except Exception as exc:
                answer = Failed(f"{type(exc).__name__}: {exc}")
            _reply(answer)
    finally:
        await worker.close()


async def _at_eof(reader: asyncio.StreamReader) -> None:
    """Return once the runner closes our stdin.

    The runner sends nothing while a request runs, so no byte of the next one is consumed here.
    """
    if await reader.read(1):
        raise RuntimeError("the runner sent a request while another one was running")


def serve(make: Callable[[], Handler]) -> None:
    """Serve the runner's requests with the handler `make` gives, until stdin closes."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve(make))


def main() -> None:
    """Serve the runner's requests until stdin closes."""
    serve(_Worker)


if __name__ == "__main__":
    main()
