"""The repair routes under /admin/: force, pause and resume an instance or a workflow, over
HTTP, on the memory store and on PostgreSQL. A paused instance answers its events with 409
instance-paused; a refused repair writes nothing."""

from __future__ import annotations

import httpx

from flowlock.service import ServiceSettings
from flowlock.service.settings import parse_tokens
from service.kit import Service, assert_problem, create, served, snapshot


async def test_force_with_a_reason_and_a_replay(client: httpx.AsyncClient) -> None:
    await create(client, "approval", "h1", n=1)
    body = {"state": "rejected", "reason": "stuck", "actor": "ops"}
    first = await client.post(
        "/admin/instances/h1/force", json=body, headers={"Idempotency-Key": "fix-1"}
    )
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["applied"] and answer["event"] == "flowlock:force"
    assert answer["instance"]["state"] == "rejected" and answer["instance"]["data"] == {"n": 1}
    again = await client.post(
        "/admin/instances/h1/force", json=body, headers={"Idempotency-Key": "fix-1"}
    )
    assert again.json() == answer and again.headers["idempotent-replayed"] == "true"
    history = (await client.get("/instances/h1/history")).json()["items"]
    assert [(r["kind"], r["actor"], r["payload"]) for r in history] == [
        ("forced", "ops", {"reason": "stuck", "state": "rejected"})
    ]


async def test_a_paused_instance_answers_409_instance_paused(client: httpx.AsyncClient) -> None:
    await create(client, "approval", "h2")
    paused = await client.post("/admin/instances/h2/pause", json={"reason": "audit"})
    assert paused.status_code == 200 and paused.json()["instance"]["paused"] is True
    refused = await client.post("/instances/h2/events/approve")
    body = assert_problem(refused, 409, "instance-paused")
    assert (body["instance_id"], body["scope"], body["version"]) == ("h2", "instance", 2)
    shown = (await client.get("/instances/h2")).json()
    assert shown["paused"] is True and shown["workflow_paused"] is False
    forced = await client.post(
        "/admin/instances/h2/force", json={"state": "approved", "reason": "ok", "actor": "ops"}
    )
    assert forced.status_code == 200 and forced.json()["instance"]["paused"] is True
    resumed = await client.post("/admin/instances/h2/resume")
    assert resumed.status_code == 200 and resumed.json()["instance"]["paused"] is False
    history = (await client.get("/instances/h2/history")).json()["items"]
    assert [r["kind"] for r in history] == ["pause", "forced", "resume"]


async def test_a_workflow_pause_over_http(client: httpx.AsyncClient) -> None:
    await create(client, "approval", "h3")
    paused = await client.post("/admin/workflows/approval/pause", json={"reason": "deploy"})
    assert paused.status_code == 200, paused.text
    assert paused.json()["workflow"] == "approval" and paused.json()["reason"] == "deploy"
    listed = (await client.get("/admin/workflows/pauses")).json()["items"]
    assert listed == [paused.json()]
    body = assert_problem(await client.post("/instances/h3/events/approve"), 409, "instance-paused")
    assert (body["scope"], body["workflow"]) == ("workflow", "approval")
    assert (await client.get("/instances/h3")).json()["workflow_paused"] is True
    lifted = await client.post("/admin/workflows/approval/resume")
    assert lifted.json() == {"lifted": paused.json()}
    again = await client.post("/admin/workflows/approval/resume")
    assert again.json() == {"lifted": None}
    assert (await client.post("/instances/h3/events/approve")).status_code == 200


async def test_bad_repairs_write_nothing(client: httpx.AsyncClient) -> None:
    await create(client, "approval", "h4")
    before = await snapshot(client, "h4")
    force = "/admin/instances/h4/force"
    body = assert_problem(
        await client.post(force, json={"state": "nowhere", "reason": "r", "actor": "ops"}),
        422,
        "unknown-state",
    )
    assert body["state"] == "nowhere" and "approved" in body["known"]
    assert_problem(
        await client.post(force, json={"state": "approved", "reason": " ", "actor": "ops"}),
        422,
        "invalid-input",
    )
    assert_problem(
        await client.post(force, json={"state": "approved", "reason": "r"}), 422, "actor-required"
    )
    assert_problem(await client.post(force, json={"state": "approved"}), 422, "invalid-request")
    assert_problem(
        await client.post("/admin/instances/h4/pause", json={"reason": ""}), 422, "invalid-input"
    )
    assert_problem(
        await client.post("/admin/workflows/nope/pause", json={"reason": "r"}),
        422,
        "unknown-workflow",
    )
    assert await snapshot(client, "h4") == before
    assert (await client.get("/admin/workflows/pauses")).json() == {"items": []}


async def test_instance_paused_on_postgresql(pg_service: Service) -> None:
    client = pg_service.client
    await create(client, "approval", "pg-1")
    assert (await client.post("/admin/instances/pg-1/pause", json={"reason": "a"})).is_success
    assert_problem(await client.post("/instances/pg-1/events/approve"), 409, "instance-paused")
    assert (await client.post("/admin/instances/pg-1/resume", json={})).is_success
    assert (await client.post("/instances/pg-1/events/approve")).status_code == 200


async def test_the_admin_token_is_the_actor_and_a_write_token_cannot_force() -> None:
    tokens = parse_tokens("ops:ops-secret-0123456789:admin,app:app-secret-0123456789:write")
    ops = {"Authorization": "Bearer ops-secret-0123456789"}
    app = {"Authorization": "Bearer app-secret-0123456789"}
    async with served(ServiceSettings(api_tokens=tokens)) as svc:
        client = svc.client
        new = {"workflow": "approval", "id": "t"}
        created = await client.post("/instances", json=new, headers=app)
        assert created.status_code == 201, created.text
        body = {"state": "approved", "reason": "r", "actor": "someone else"}
        assert_problem(
            await client.post("/admin/instances/t/force", json=body, headers=app),
            403,
            "insufficient-scope",
        )
        forced = await client.post("/admin/instances/t/force", json=body, headers=ops)
        assert forced.status_code == 200, forced.text
        rows = (await client.get("/instances/t/history", headers=ops)).json()["items"]
        assert [(r["kind"], r["actor"]) for r in rows] == [("forced", "ops")]
        pause = "/admin/workflows/approval/pause"
        paused = await client.post(pause, json={"reason": "r"}, headers=ops)
        assert paused.json()["actor"] == "ops"
