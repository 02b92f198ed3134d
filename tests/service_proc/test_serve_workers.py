"""``flowlock serve --workers 2`` on PostgreSQL, as a real process, under concurrent HTTP callers.

The seed's three races over HTTP: 100 administrators approving one request, 100 retries of one
request sharing an Idempotency-Key, 100 buyers for 50 units. Each answer is checked as a client
sees it, then the history is read back with an engine of the test's own and checked for
exactly-once (``flowlock.checker.check``). Both workers serve: each one's share of the calls is
read from the counter file it writes in the shared metrics directory, and /metrics (whichever
worker answers it) reports the calls of both.

One server and one fresh database for the module (the service has no schema flag).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Served, Services, fresh_database, read_back

from flowlock.checker import check

pytestmark = pytest.mark.slow

CALLERS = 100
GUARD_REJECTED = "urn:flowlock:problem:guard-rejected"


@pytest.fixture(scope="module")
def database(pg_url: str) -> Iterator[str]:
    with fresh_database(pg_url) as url:
        yield url


@pytest.fixture(scope="module")
def server(database: str) -> Iterator[Served]:
    with Services() as services:
        # 8 connections a worker: the 100 callers queue for them, as in production, and the
        # service stays well inside a busy server's connections (tests/pg_budget.py).
        yield services.start("--database-url", database, "--pool-size", "8", workers=2)


def client(server: Served, *, keep_alive: bool = True) -> httpx.AsyncClient:
    """Room for every caller to have a connection of its own at once."""
    limits = httpx.Limits(
        max_connections=CALLERS, max_keepalive_connections=CALLERS if keep_alive else 0
    )
    return httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60.0)


async def create(http: httpx.AsyncClient, workflow: str, instance_id: str, **data: Any) -> None:
    answer = await http.post(
        "/instances", json={"workflow": workflow, "id": instance_id, "data": data}
    )
    assert answer.status_code == 201, answer.text


def worker_shares(server: Served, before: dict[int, float]) -> dict[int, float]:
    """Each worker's approval calls since ``before``."""
    after = server.transitions_by_pid("approval")
    return {pid: n - before.get(pid, 0.0) for pid, n in after.items()}


async def test_a_hundred_admins_approve_once(server: Served, database: str) -> None:
    before = server.transitions_by_pid("approval")
    async with client(server) as http:
        await create(http, "approval", "req-1")
        answers = await asyncio.gather(
            *(
                http.post("/instances/req-1/events/approve", json={"actor": f"admin-{n}"})
                for n in range(CALLERS)
            )
        )
    assert [a.status_code for a in answers] == [200] * CALLERS, {a.text for a in answers}
    bodies = [a.json() for a in answers]
    winners = [b for b in bodies if b["applied"]]
    losers = [b for b in bodies if not b["applied"]]
    assert len(winners) == 1 and len(losers) == CALLERS - 1
    assert all(b["idempotent"] for b in losers) and not winners[0]["idempotent"]
    assert all(b["instance"]["state"] == "approved" for b in bodies)
    # Nobody retried: no answer is marked as a replay.
    assert not any("idempotent-replayed" in a.headers for a in answers)
    # Both workers took part (100 connections opened at once; the kernel spreads them).
    shares = worker_shares(server, before)
    assert sum(shares.values()) == CALLERS and all(n > 0 for n in shares.values()), shares

    found = await read_back(database, ["req-1"])
    inst, history = found["req-1"]
    verdict = check(inst, history, initial_state="pending", expected_applied=1)
    assert verdict.ok, verdict
    assert history[0].version == winners[0]["instance"]["version"] == 2
    assert (history[0].actor or "").startswith("admin-")


async def test_a_hundred_retries_of_one_key_apply_once(server: Served, database: str) -> None:
    async with client(server) as http:
        await create(http, "approval", "req-2")
        answers = await asyncio.gather(
            *(
                http.post(
                    "/instances/req-2/events/approve",
                    headers={"Idempotency-Key": "key-2"},
                    json={"actor": "admin"},
                )
                for _ in range(CALLERS)
            )
        )
    assert [a.status_code for a in answers] == [200] * CALLERS, {a.text for a in answers}
    # Byte for byte the same answer, whichever worker served it and whether it ran or waited.
    assert len({a.content for a in answers}) == 1
    body = answers[0].json()
    assert body["applied"] is True and body["request_id"] == "key-2"
    replays = [a for a in answers if a.headers.get("idempotent-replayed") == "true"]
    assert len(replays) == CALLERS - 1

    found = await read_back(database, ["req-2"])
    inst, history = found["req-2"]
    assert [e.request_id for e in history] == ["key-2"]
    verdict = check(inst, history, initial_state="pending", expected_applied=1)
    assert verdict.ok, verdict


def never_oversold(data: Mapping[str, Any]) -> str | None:
    if data.get("stock", 0) < 0:
        return f"stock went below zero: {data}"
    if data.get("stock", 0) + data.get("reserved", 0) != 50:
        return f"units appeared or vanished: {data}"
    return None


async def test_a_hundred_buyers_for_fifty_units(server: Served, database: str) -> None:
    async with client(server) as http:
        await create(http, "inventory", "sku-1", stock=50, reserved=0)
        answers = await asyncio.gather(
            *(
                http.post(
                    "/instances/sku-1/events/reserve",
                    json={"payload": {"qty": 1}, "actor": f"buyer-{n}"},
                )
                for n in range(CALLERS)
            )
        )
        final = (await http.get("/instances/sku-1")).json()
    sold = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 422]
    assert len(sold) == 50 and len(refused) == 50, {a.status_code for a in answers}
    assert all(a.json()["applied"] for a in sold)
    assert {a.json()["type"] for a in refused} == {GUARD_REJECTED}
    assert final["data"] == {"stock": 0, "reserved": 50}

    found = await read_back(database, ["sku-1"])
    inst, history = found["sku-1"]
    verdict = check(
        inst,
        history,
        initial_state="open",
        expected_applied=50,
        invariant=never_oversold,
        invariant_kind="oversell",
    )
    assert verdict.ok, verdict
    buyers = {a.json()["instance"]["version"]: a for a in sold}
    assert sorted(buyers) == [e.version for e in history]


def transitions(exposition: str, workflow: str) -> dict[str, float]:
    """``flowlock_transitions_total`` of ``workflow`` by outcome, from a /metrics answer."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "flowlock_transitions_total" and (
                sample.labels.get("workflow") == workflow
            ):
                outcome = sample.labels["outcome"]
                totals[outcome] = totals.get(outcome, 0.0) + sample.value
    return totals


async def sign_round(http: httpx.AsyncClient, prefix: str, documents: int) -> dict[str, int]:
    """``documents`` countersign documents (quorum 3), all at once: two signatures, the first
    signer again (refused: already signed), the third signature (approved), a latecomer (an
    idempotent answer: the document is approved already). The outcomes the callers saw."""
    ids = [f"{prefix}-{n}" for n in range(documents)]
    await asyncio.gather(*(create(http, "countersign", i) for i in ids))

    async def sign(actor: str) -> list[httpx.Response]:
        return await asyncio.gather(
            *(http.post(f"/instances/{i}/events/sign", json={"actor": actor}) for i in ids)
        )

    seen: dict[str, int] = {}
    for actor in ("signer-0", "signer-1", "signer-0", "signer-2", "latecomer"):
        for answer in await sign(actor):
            if answer.status_code == 422:
                assert answer.json()["type"] == GUARD_REJECTED, answer.text
                outcome = "refused"
            else:
                assert answer.status_code == 200, answer.text
                outcome = "applied" if answer.json()["applied"] else "idempotent"
            seen[outcome] = seen.get(outcome, 0) + 1
    assert seen == {"applied": 3 * documents, "refused": documents, "idempotent": documents}
    return seen


async def test_metrics_add_up_the_calls_of_both_workers(server: Served) -> None:
    """The counters /metrics reports are the sum over the workers, and equal the calls made.
    Only countersign's counters are compared: no other test here fires at it."""
    seen: dict[str, int] = {}
    async with client(server, keep_alive=False) as http:
        # A fresh connection per call, accepted by either worker; rounds until both have served
        # (the kernel picks; the first round nearly always spreads them).
        for round_no in range(5):
            for outcome, n in (await sign_round(http, f"doc-{round_no}", 20)).items():
                seen[outcome] = seen.get(outcome, 0) + n
            shares = server.transitions_by_pid("countersign")
            if sum(1 for v in shares.values() if v > 0) == 2:
                break
        assert sum(1 for v in shares.values() if v > 0) == 2, shares
        assert sum(shares.values()) == sum(seen.values())
        # Ask more than once: each answer may come from either worker, and must be the same.
        for _ in range(4):
            answer = await http.get("/metrics")
            assert answer.status_code == 200
            assert transitions(answer.text, "countersign") == seen
