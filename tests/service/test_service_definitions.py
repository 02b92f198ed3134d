"""Definition versions over HTTP: GET /definitions lists the stored versions, instance and
history bodies carry definition_version, and a fire on an instance of a version the service
does not run is a 409 definition-mismatch problem that writes nothing."""

from __future__ import annotations

import httpx

import flowlock
from flowlock import examples
from service.kit import Service, assert_problem, create


def approval_v2() -> flowlock.Workflow:
    """The example approval with one more state: a different definition, so version 2."""
    return flowlock.Workflow(
        "approval",
        states=["pending", "approved", "rejected", "escalated"],
        initial="pending",
        transitions=[
            flowlock.Transition("approve", source="pending", target="approved"),
            flowlock.Transition("reject", source="pending", target="rejected"),
            flowlock.Transition("escalate", source="pending", target="escalated"),
        ],
    )


async def test_definitions_list_the_stored_versions(client: httpx.AsyncClient) -> None:
    """Each served workflow shows the version a create pins and every stored version with its
    instance count; ?workflow= keeps one; an unknown one is a 404."""
    await create(client, "approval", "a1")
    body = (await client.get("/definitions", params={"workflow": "approval"})).json()
    [item] = body["items"]
    assert item["name"] == "approval" and item["version"] == 1
    [stored] = item["versions"]
    assert (stored["version"], stored["instances"], stored["served"]) == (1, 1, True)
    assert len(stored["hash"]) == 64 and stored["created_at"]
    names = [d["name"] for d in (await client.get("/definitions")).json()["items"]]
    assert names == ["approval", "countersign", "inventory"]
    assert_problem(
        await client.get("/definitions", params={"workflow": "nope"}), 404, "workflow-not-found"
    )


async def test_instance_and_history_bodies_carry_the_definition_version(
    client: httpx.AsyncClient,
) -> None:
    """The instance a create, fire and GET answer, and each history row, name the version."""
    await create(client, "approval", "a1")
    shown = (await client.get("/instances/a1")).json()
    assert shown["definition_version"] == 1
    fired = (await client.post("/instances/a1/events/approve", json={})).json()
    assert fired["instance"]["definition_version"] == 1
    rows = (await client.get("/instances/a1/history")).json()["items"]
    assert [r["definition_version"] for r in rows] == [1]


async def test_a_version_the_service_does_not_run_is_a_409_that_writes_nothing(
    pg_service: Service, pg_url: str, pg_schema: str
) -> None:
    """Another process created an instance under version 2; this service runs version 1 only:
    a fire answers 409 definition-mismatch naming the versions, and nothing is written."""
    client = pg_service.client
    async with flowlock.connect(pg_url, schema=pg_schema) as newer:
        await newer.register(examples.approval())
        assert await newer.register(approval_v2()) == 2
        await newer.create("approval", instance_id="n1")
    answer = await client.post("/instances/n1/events/approve", json={})
    body = assert_problem(answer, 409, "definition-mismatch")
    assert (body["instance_id"], body["workflow"], body["version"]) == ("n1", "approval", 2)
    assert body["registered"] == [1]
    shown = (await client.get("/instances/n1")).json()
    assert (shown["state"], shown["version"], shown["definition_version"]) == ("pending", 1, 2)
    assert (await client.get("/instances/n1/history")).json()["items"] == []


async def test_a_create_may_name_the_version_it_runs(client: httpx.AsyncClient) -> None:
    """POST /instances takes `version`: a version the service registered pins the instance, one
    it has not is a 409 definition-mismatch that creates nothing, and a bad one is a 422."""
    made = await client.post("/instances", json={"workflow": "approval", "id": "v1", "version": 1})
    assert made.status_code == 201 and made.json()["definition_version"] == 1
    missing = await client.post(
        "/instances", json={"workflow": "approval", "id": "v9", "version": 9}
    )
    body = assert_problem(missing, 409, "definition-mismatch")
    assert (body["workflow"], body["version"], body["registered"]) == ("approval", 9, [1])
    assert (await client.get("/instances/v9")).status_code == 404
    bad = await client.post("/instances", json={"workflow": "approval", "id": "v0", "version": 0})
    assert bad.status_code == 422
