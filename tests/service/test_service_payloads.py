"""Typed payloads over HTTP: a payload or create data its schema refuses is 422 invalid-payload
with an `errors` member (loc, msg, type) and nothing written, on the fast layer and on the
FastAPI routes, on memory and PostgreSQL; a good one applies. The OpenAPI document lists each
declared schema as a component and points the fire and create bodies at them."""

from __future__ import annotations

from typing import Any

import httpx

from flowlock.service import ServiceSettings
from flowlock.service.fast import FastRoutes
from payload_kit import BAD_ORDER, GOOD_ORDER, desk, shop
from service.kit import Service, assert_problem, create, served, snapshot


async def check_refusals(client: httpx.AsyncClient) -> None:
    """The 422s and the good calls, against the shop."""
    await create(client, "shop", "s", customer="ann")
    before = await snapshot(client, "s")
    refused = await client.post("/instances/s/events/pay", json={"payload": BAD_ORDER})
    body = assert_problem(refused, 422, "invalid-payload")
    assert body["errors"] == [
        {"loc": ["items", 0, "sku"], "msg": "Field required", "type": "missing"},
        {"loc": ["items", 0, "qty"], "msg": "Input should be greater than or equal to 1",
         "type": "greater_than_equal"},
    ]  # fmt: skip
    assert body["workflow"] == "shop" and body["event"] == "pay"
    assert "items.0.sku" in body["detail"]
    assert await snapshot(client, "s") == before
    created = await client.post("/instances", json={"workflow": "shop", "id": "s2", "data": {}})
    data = assert_problem(created, 422, "invalid-payload")
    assert data["errors"][0]["loc"] == ["customer"] and data["event"] is None
    assert (await client.get("/instances/s2")).status_code == 404
    fired = await client.post("/instances/s/events/pay", json={"payload": GOOD_ORDER})
    assert fired.status_code == 200, fired.text
    assert fired.json()["instance"]["data"]["units"] == 5
    history = (await client.get("/instances/s/history")).json()["items"]
    assert history[-1]["payload"] == GOOD_ORDER


async def test_a_bad_payload_is_422_with_its_errors_and_writes_nothing() -> None:
    """On the fast layer (memory store): 422 invalid-payload listing each field; bad create
    data the same; a good payload applies and the history keeps its JSON."""
    async with served(workflows=[shop(), desk()]) as svc:
        await check_refusals(svc.client)


async def test_the_framework_routes_answer_the_same(pg_url: str, pg_schema: str) -> None:
    """With the fast layer taken out (FastAPI's own routes answer), on PostgreSQL: the same 422
    problems, nothing written, and the good calls apply."""
    settings = ServiceSettings(database_url=pg_url, schema=pg_schema)
    async with served(settings, workflows=[shop(), desk()]) as svc:
        # Before the first request, while the middleware stack is not built yet.
        app: Any = svc.app  # Starlette types the factory apart from the class it holds
        app.user_middleware = [m for m in app.user_middleware if m.cls is not FastRoutes]
        await check_refusals(svc.client)
        layer: Any = svc.app.middleware_stack
        while layer is not None:  # the stack that answered has no fast layer in it
            assert not isinstance(layer, FastRoutes)
            layer = getattr(layer, "app", None)


def components(document: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = document["components"]["schemas"]
    return found


async def test_the_openapi_document_describes_each_declared_schema(service: Service) -> None:
    """The default app (its inventory is typed) and one serving the shop: each declared schema
    is a component `<workflow>.<event>` (data: `<workflow>._data`), nested models hoisted
    beside it, and the fire/create bodies point at them with anyOf and a description."""
    default = service.app.openapi()
    assert components(default)["inventory.reserve"]["properties"]["qty"]["minimum"] == 1
    async with served(workflows=[shop(), desk()]) as svc:
        document = svc.app.openapi()
    schemas = components(document)
    assert schemas["shop.pay"]["properties"]["items"]["items"] == {
        "$ref": "#/components/schemas/shop.pay.Item"
    }
    assert "$defs" not in schemas["shop.pay"]
    assert schemas["shop.pay.Item"]["required"] == ["sku", "qty"]
    assert schemas["desk.note"] != schemas["shop.note"]
    assert schemas["shop._data"]["required"] == ["customer"]
    fire = document["paths"]["/instances/{instance_id}/events/{event}"]["post"]
    payload = fire["requestBody"]["content"]["application/json"]["schema"]["properties"]["payload"]
    refs = [option.get("$ref") for option in payload["anyOf"]]
    assert "#/components/schemas/shop.pay" in refs and "#/components/schemas/desk.ship" in refs
    assert refs[-1] is None  # reopen takes any object
    assert "`pay` (workflow `shop`): `shop.pay`" in payload["description"]
    create_body = document["paths"]["/instances"]["post"]["requestBody"]["content"]
    data = create_body["application/json"]["schema"]["properties"]["data"]
    assert [o["$ref"] for o in data["anyOf"]] == [
        "#/components/schemas/shop._data",
        "#/components/schemas/desk._data",
    ]
