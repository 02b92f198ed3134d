"""The outbox's crash matrix on PostgreSQL: 1,500 orders (3,000 transitions, 3,000 messages)
driven through a two-handler chain by worker processes that are SIGKILLed before a commit, after
a commit and before dispatch, inside a handler, and after a handler and before its message is
marked done (tests/integration/outbox_worker.py), with batching on and off and with three
strategies; then two clean workers finish the work side by side.

Afterwards: no message for a transition that is not in the history, every committed message
delivered (done) and recorded once in the sink (whose unique key index is the receiving side's
idempotency), redeliveries seen, every `Then` applied once, the checker clean.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import flowlock
from flowlock.checker import check_many
from flowlock.stores.postgres import PostgresStore
from outbox_kit import SINK_SQL, order

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

WORKER = Path(__file__).with_name("outbox_worker.py")
ORDERS = 1_500
BOUND = 150.0  # the most the test waits for one round of workers


async def _run(configs: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """Start one worker per config at once; wait for all (killed ones end with -9)."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            json.dumps(cfg),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for cfg in configs
    ]
    done = []
    try:
        for proc in procs:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=BOUND)
            assert proc.returncode is not None
            done.append((proc.returncode, out.decode(), err.decode()))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return done


async def test_the_outbox_crash_matrix(pg_url: str, pg_schema: str, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    ids = [f"o{n:04}" for n in range(ORDERS)]
    store = PostgresStore(pg_url, schema=pg_schema, pool_size=4)
    async with flowlock.Engine(store, outbox=False) as engine:
        await engine.register(order())
        for start in range(0, ORDERS, 250):
            await asyncio.gather(
                *(engine.create("order", instance_id=i) for i in ids[start : start + 250])
            )
    sink = await asyncpg.connect(pg_url, server_settings={"search_path": pg_schema})
    try:
        await sink.execute(SINK_SQL)
        base = {"url": pg_url, "schema": pg_schema, "markers": str(markers)}
        shares = [ids[p::4] for p in range(4)]
        victim = shares[0][len(shares[0]) // 2]
        # Round 1: each crash point in its own process, all at once.
        first = await _run(
            [
                {**base, "proc": 0, "crash": "before-commit", "ids": shares[0], "victim": victim,
                 "batching": True, "strategy": "optimistic"},
                {**base, "proc": 1, "crash": "after-commit", "ids": shares[1],
                 "batching": False, "strategy": "pessimistic"},
                {**base, "proc": 2, "crash": "in-handler", "ids": shares[2],
                 "batching": True, "strategy": "adaptive", "linger": 20.0},
                {**base, "proc": 3, "crash": "before-done", "ids": shares[3],
                 "batching": False, "strategy": "optimistic", "linger": 20.0},
            ]
        )  # fmt: skip
        codes = [code for code, _, _ in first]
        assert codes[:2] == [-9, -9], [err[-2000:] for _, _, err in first]
        # Round 2: the two handler crash points again, on the work the first round left.
        second = await _run(
            [
                {**base, "proc": p, "crash": crash, "ids": [], "batching": True,
                 "strategy": "optimistic", "linger": 15.0}
                for p, crash in ((4, "in-handler"), (5, "before-done"))
            ]
        )  # fmt: skip
        for code, _, err in (*first[2:], *second):
            assert code in (0, -9), err[-3000:]
        killed = sum(code == -9 for code, _, _ in (*first, *second))
        # The victim's submit died before its commit: nothing of it is in the database.
        async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema), outbox=False) as e:
            await e.register(order())
            assert (await e.get(victim)).state == "placed"
            assert await e.history(victim) == []
            assert await e.messages(victim) == []
        # Round 3: two clean workers resubmit what was lost and deliver everything, side by side.
        final = await _run(
            [
                {**base, "proc": p, "crash": "none", "ids": ids, "batching": p == 6,
                 "strategy": "optimistic"}
                for p in (6, 7)
            ]
        )  # fmt: skip
        for code, _, err in final:
            assert code == 0, err[-3000:]

        rows = await sink.fetch("SELECT key, kind FROM outbox_sink ORDER BY key")
        deliveries = await sink.fetch("SELECT key, pid, at FROM outbox_deliveries")
    finally:
        await sink.close()

    async with flowlock.Engine(PostgresStore(pg_url, schema=pg_schema), outbox=False) as engine:
        await engine.register(order())
        instances = {i: await engine.get(i) for i in ids}
        histories = {i: await engine.history(i) for i in ids}
        messages = {i: await engine.messages(i) for i in ids}

    # Every order went the whole chain, each transition once.
    assert {inst.state for inst in instances.values()} == {"paid"}
    for iid in ids:
        assert [h.event for h in histories[iid]] == ["submit", "paid"], iid
        # The Then fired under the charge message's key: applied once, however often delivered.
        assert histories[iid][1].request_id == f"{iid}:2:0"
        assert [(m.key, m.kind, m.status) for m in messages[iid]] == [
            (f"{iid}:2:0", "charge", "done"),
            (f"{iid}:3:0", "ship", "done"),
        ], iid
    # No message without its transition; every message recorded once in the sink.
    keys = {m.key for ms in messages.values() for m in ms}
    assert len(keys) == 2 * ORDERS
    assert [r["key"] for r in rows] == sorted(keys)
    # At least once, shown: the killed handlers' messages were delivered again.
    delivered = [d["key"] for d in deliveries]
    redelivered = len(delivered) - len(set(delivered))
    assert redelivered > 0
    # Both handler crash points were reached (a marker per key that died there).
    assert {m.name.rsplit("-o", 1)[0] for m in markers.iterdir()} == {"in-handler", "before-done"}
    # The two clean workers delivered side by side.
    final_pids = {int(json.loads(out.splitlines()[-1])["pid"]) for _, out, _ in final}
    spans = [
        (
            min(d["at"] for d in deliveries if d["pid"] == pid),
            max(d["at"] for d in deliveries if d["pid"] == pid),
        )
        for pid in final_pids
        if any(d["pid"] == pid for d in deliveries)
    ]
    assert len(spans) == 2 and max(s[0] for s in spans) < min(s[1] for s in spans), spans
    verdict = check_many(
        [(instances[i], histories[i]) for i in ids], initial_state="placed", expected_applied=2
    )
    assert verdict.ok, verdict.violations
    print(
        f"crash matrix: {killed} processes killed, {redelivered} redeliveries, {len(keys)} messages"
    )
