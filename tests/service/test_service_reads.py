"""The read side: instances (ETag, Location), history pages, list filters and cursors, the
workflow definitions and diagrams, and the health and metrics endpoints."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx

import pg_budget
from service.kit import Service, assert_problem, create


async def test_create_answers_201_with_etag_and_location(client: httpx.AsyncClient) -> None:
    """A create is 201 with ETag "1" and the instance's Location, which GET answers with the
    same ETag; instance_id is accepted for id, and an omitted id is a fresh UUID."""
    created = await client.post(
        "/instances", json={"workflow": "approval", "instance_id": "r-1", "data": {"n": 1}}
    )
    assert created.status_code == 201, created.text
    assert created.headers["etag"] == '"1"'
    assert created.headers["location"] == "/instances/r-1"
    body = created.json()
    assert (body["id"], body["state"], body["version"]) == ("r-1", "pending", 1)
    assert body["allowed"] == ["approve", "reject"]
    assert body["data"] == {"n": 1}
    got = await client.get(created.headers["location"])
    assert got.json() == {**body, "next_timer": None}  # GET reads the next timer too
    assert got.headers["etag"] == '"1"'
    anonymous = await client.post("/instances", json={"workflow": "approval"})
    assert anonymous.status_code == 201, anonymous.text
    assert len(anonymous.json()["id"]) == 36


async def test_location_percent_encodes_the_id(client: httpx.AsyncClient) -> None:
    """An id with characters a header cannot carry raw (beyond latin-1) or that would change
    the URL ('?', '#', ' ', '%'): created (201, not a crash after the write), its Location
    percent-encoded, and following it finds the instance."""
    for iid, location in [
        ("\U00013000-1", "/instances/%F0%93%80%80-1"),
        ("é ?#%", "/instances/%C3%A9%20%3F%23%25"),
    ]:
        created = await client.post("/instances", json={"workflow": "approval", "id": iid})
        assert created.status_code == 201, created.text
        assert created.headers["location"] == location
        followed = await client.get(location)
        assert followed.status_code == 200, followed.text
        assert followed.json()["id"] == iid


async def test_history_pages_walk_every_entry_once(client: httpx.AsyncClient) -> None:
    """Seven transitions read two at a time by following next_cursor: every version 2..8 once,
    in order, and the last page says there is no next one."""
    await create(client, "inventory", "i")
    for qty in range(1, 8):
        fired = await client.post("/instances/i/events/restock", json={"payload": {"qty": qty}})
        assert fired.status_code == 200, fired.text
    seen: list[int] = []
    pages = 0
    after = 0
    while True:
        page = (await client.get(f"/instances/i/history?after={after}&limit=2")).json()
        pages += 1
        assert len(page["items"]) <= 2
        seen += [e["version"] for e in page["items"]]
        if page["next_cursor"] is None:
            break
        after = page["next_cursor"]
    assert seen == list(range(2, 9))
    assert pages == 4
    whole = (await client.get("/instances/i/history")).json()
    assert [e["payload"] for e in whole["items"]] == [{"qty": q} for q in range(1, 8)]
    assert whole["items"][0]["from_state"] == "open"
    assert whole["items"][-1]["data"] == {"stock": 28}
    assert whole["next_cursor"] is None
    # Past the end: an empty page; a full last page says so too.
    assert (await client.get("/instances/i/history?after=8")).json() == {
        "items": [],
        "next_cursor": None,
    }
    last = (await client.get("/instances/i/history?after=6&limit=2")).json()
    assert [e["version"] for e in last["items"]] == [7, 8]
    assert last["next_cursor"] is None


async def list_ids(client: httpx.AsyncClient, query: str) -> list[str]:
    response = await client.get(f"/instances?{query}")
    assert response.status_code == 200, response.text
    page = response.json()
    assert page["next_cursor"] is None
    return sorted(i["id"] for i in page["items"])


async def test_list_filters_and_cursor(client: httpx.AsyncClient) -> None:
    """Filters by workflow, by one or several states, by update time; the cursor walks every
    match once."""
    for n in range(5):
        await create(client, "approval", f"a{n}")
    await create(client, "inventory", "i0")
    for iid, event in [("a0", "approve"), ("a1", "approve"), ("a2", "reject")]:
        assert (await client.post(f"/instances/{iid}/events/{event}")).status_code == 200
    assert await list_ids(client, "workflow=approval&state=approved") == ["a0", "a1"]
    assert await list_ids(client, "workflow=approval&state=approved&state=rejected") == [
        "a0",
        "a1",
        "a2",
    ]
    assert await list_ids(client, "state=pending") == ["a3", "a4"]
    assert await list_ids(client, "workflow=inventory") == ["i0"]
    assert await list_ids(client, "workflow=countersign") == []
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    assert await list_ids(client, f"updated_after={future.replace('+', '%2B')}") == []
    assert len(await list_ids(client, f"updated_after={past.replace('+', '%2B')}")) == 6
    assert len(await list_ids(client, f"updated_before={future.replace('+', '%2B')}")) == 6
    seen: list[str] = []
    cursor: str | None = None
    while True:
        query = "workflow=approval&limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = (await client.get(f"/instances?{query}")).json()
        assert len(page["items"]) <= 2
        seen += [i["id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == [f"a{n}" for n in range(5)]
    assert len(seen) == 5


async def test_definitions_and_diagrams(client: httpx.AsyncClient) -> None:
    """The served workflows, one with its transitions, and its Mermaid diagram as text/plain;
    an unknown workflow's diagram is a 404 problem."""
    listed = (await client.get("/definitions")).json()["items"]
    assert [d["name"] for d in listed] == ["approval", "countersign", "inventory"]
    inventory = (await client.get("/definitions/inventory")).json()
    assert inventory["states"] == ["open"]
    assert inventory["initial"] == "open"
    assert inventory["strategy"] == "pessimistic"
    guarded = {t["event"]: t["guarded"] for t in inventory["transitions"]}
    assert guarded == {"reserve": True, "restock": False}
    approval = (await client.get("/definitions/approval")).json()
    assert approval["final"] == ["approved", "rejected"]
    diagram = await client.get("/definitions/approval/diagram")
    assert diagram.status_code == 200
    assert diagram.headers["content-type"].startswith("text/plain")
    assert diagram.text.startswith("stateDiagram-v2")
    assert "pending --> approved: approve" in diagram.text
    assert_problem(await client.get("/definitions/nope/diagram"), 404, "workflow-not-found")


async def test_health_and_metrics(service: Service) -> None:
    """/livez and /readyz answer ok; /metrics counts an applied transition."""
    client = service.client
    assert (await client.get("/livez")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"database": "ok"}}
    await create(client, "approval", "a")
    assert (await client.post("/instances/a/events/approve")).status_code == 200
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    applied = [
        line
        for line in metrics.text.splitlines()
        if line.startswith("flowlock_transitions_total{") and 'outcome="applied"' in line
    ]
    assert len(applied) == 1, metrics.text
    assert 'event="approve"' in applied[0]
    assert applied[0].endswith(" 1.0")


async def test_readyz_on_postgresql(pg_service: Service) -> None:
    """/readyz pings PostgreSQL: ok."""
    ready = await pg_service.client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok"}


async def test_the_schema_setting_puts_the_tables_there(
    pg_service: Service, pg_url: str, pg_schema: str
) -> None:
    """``--schema`` / FLOWLOCK_SCHEMA: flowlock's tables and rows are in that schema."""
    await create(pg_service.client, "approval", "in-schema")
    conn = await pg_budget.connect(pg_url)
    try:
        found = await conn.fetchval(
            f'SELECT count(*) FROM "{pg_schema}".flowlock_instances WHERE id = $1', "in-schema"
        )
    finally:
        await conn.close()
    assert found == 1
