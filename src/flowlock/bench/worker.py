"""A benchmark worker process: ``python -m flowlock.bench.worker``.

The runner starts ``--processes`` of these for the multi-process scenarios (``cluster``,
``singleton``) and drives them with one JSON object per line on stdin; each request gets one
JSON line back on stdout (``{"op": "error", "message": ...}`` when it failed):

- ``{"op": "open", "target": {...}, "pool_size": n, "scenario": s, "strategy": t, "params":
  {...}, "seed": "..."}``: open a fresh session for the strategy (its own pool, engine and lock
  backend, exactly as the runner opens one in-process) -> ``{"op": "opened"}``;
- ``{"op": "arm", "lanes": [[call, ...], ...]}``: create one task per lane, parked on a gate
  -> ``{"op": "armed"}`` once all of them wait;
- ``{"op": "go"}``: release them -> ``{"op": "done", "results": [...], "wall": s,
  "lease_wait": s}``; latencies are measured here, from this process's release;
- ``{"op": "close"}``: close the session -> ``{"op": "closed"}``.

End of input (the runner closed the pipe, or died) closes everything and exits. The worker runs
in its own session (the runner starts it so), so a Ctrl-C in the terminal reaches only the
runner, which then closes the workers in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Mapping
from typing import Any

from flowlock.bench.runner import (
    STRATEGIES,
    Armed,
    BenchSession,
    Target,
    loop_factory,
    open_session,
)
from flowlock.bench.scenarios import SCENARIOS, CallSpec, Params, Scenario

__all__ = ["main"]


def _reply(message: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class _Worker:
    def __init__(self) -> None:
        self._stack: contextlib.AsyncExitStack | None = None
        self._session: BenchSession | None = None
        self._scenario: Scenario | None = None
        self._armed: Armed | None = None

    async def handle(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "open":
            await self.close()
            scenario = SCENARIOS[msg["scenario"]]
            params = Params(**msg["params"])
            stack = contextlib.AsyncExitStack()
            try:
                self._session = await stack.enter_async_context(
                    open_session(
                        STRATEGIES[msg["strategy"]],
                        Target.from_json(msg["target"]),
                        scenario,
                        params,
                        random.Random(msg["seed"]),
                        pool_size=int(msg["pool_size"]),
                    )
                )
            except BaseException:
                await stack.aclose()
                raise
            self._stack, self._scenario = stack, scenario
            return {"op": "opened"}
        if op == "arm":
            if self._session is None or self._scenario is None:
                raise RuntimeError("arm before open")
            lanes = [[CallSpec.from_json(c) for c in lane] for lane in msg["lanes"]]
            self._armed = Armed(self._scenario, self._session, lanes)
            await self._armed.ready()
            return {"op": "armed"}
        if op == "go":
            if self._armed is None or self._session is None:
                raise RuntimeError("go before arm")
            armed, self._armed = self._armed, None
            leased = self._session.lease_wait
            results, wall = await armed.go()
            return {
                "op": "done",
                "results": [r.to_json() for r in results],
                "wall": wall,
                "lease_wait": self._session.lease_wait - leased,
            }
        if op == "close":
            await self.close()
            return {"op": "closed"}
        raise RuntimeError(f"unknown request {op!r}")

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


async def _serve() -> None:
    worker = _Worker()
    reader = await _lines()
    try:
        while line := await reader.readline():
            request = asyncio.create_task(worker.handle(json.loads(line)))
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
                answer = {"op": "error", "message": f"{type(exc).__name__}: {exc}"}
            _reply(answer)
    finally:
        await worker.close()


async def _at_eof(reader: asyncio.StreamReader) -> None:
    """Returns once the runner closed our stdin. The runner sends nothing while a request runs
    (it waits for the answer), so no byte of a next request is ever consumed here."""
    if await reader.read(1):
        raise RuntimeError("the runner sent a request while another one was running")


def main() -> None:
    """Serve the runner's requests until stdin closes."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve())


if __name__ == "__main__":
    main()
