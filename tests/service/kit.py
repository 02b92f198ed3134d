"""What the service tests share: the app run in-process (its lifespan opens and closes the engine)
with an httpx client on it, and the checks every RFC 9457 problem must pass."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from flowlock.core.definition import Workflow
from flowlock.engine import Engine
from flowlock.service import ServiceSettings, create_app

PROBLEM_JSON = "application/problem+json"
TYPE_PREFIX = "urn:flowlock:problem:"
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Service:
    """A running app, a client on it, and its engine (to read the store without HTTP)."""

    app: FastAPI
    client: httpx.AsyncClient
    engine: Engine


@asynccontextmanager
async def served(
    settings: ServiceSettings | None = None, *, workflows: Sequence[Workflow] | None = None
) -> AsyncIterator[Service]:
    """The app over ``settings``, between its lifespan's start and end, as uvicorn runs it."""
    app = create_app(settings, workflows=workflows)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield Service(app, client, app.state.engine)


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    """``response`` is the RFC 9457 problem ``slug`` with ``status``; its members, returned."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_JSON, response.headers
    body: dict[str, Any] = response.json()
    assert body["type"] == TYPE_PREFIX + slug, body
    assert body["status"] == status, body
    assert isinstance(body["title"], str) and body["title"], body
    assert isinstance(body["detail"], str) and body["detail"], body
    assert body["instance"] == response.request.url.path, body
    return body


async def create(client: httpx.AsyncClient, workflow: str, iid: str, **data: Any) -> None:
    response = await client.post("/instances", json={"workflow": workflow, "id": iid, "data": data})
    assert response.status_code == 201, response.text


async def snapshot(
    client: httpx.AsyncClient, iid: str, headers: dict[str, str] | None = None
) -> tuple[Any, ...]:
    """What must not change when a request is refused: the instance and its whole history
    (read with ``headers``: a token, when the service has tokens)."""
    got = await client.get(f"/instances/{iid}", headers=headers)
    assert got.status_code == 200, got.text
    history = await client.get(f"/instances/{iid}/history", headers=headers)
    assert history.status_code == 200, history.text
    inst = got.json()
    return (inst["state"], inst["version"], inst["data"], got.headers["etag"], history.json())
