"""Constraints over HTTP, on a real engine (memory store): a full key is 409 capacity-reached, a
second holder of a unique key 409 unique-violation, a rate over its limit 429 rate-limited with
Retry-After, each writing nothing; GET /capacity/{kind}/{key} shows the holders and the limit,
under the read scope."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

import flowlock
from flowlock.service import ServiceSettings
from flowlock.service.guard import needed_scope
from flowlock.stores import MemoryStore
from flowlock.stores.constraint_store import ConstraintStore
from service.kit import Service, assert_problem, create, served, snapshot

if not hasattr(flowlock.Engine, "capacity"):
    pytest.skip(
        "Engine.capacity is not merged yet (the lead's engine side)", allow_module_level=True
    )
if not isinstance(MemoryStore(), ConstraintStore):
    pytest.skip("MemoryStore keeps no constraints yet (the stores' side)", allow_module_level=True)

CAP = "review.in_review"


def _reviewer(inst: flowlock.Instance) -> str:
    return str(inst.data["reviewer"])


def _customer(inst: flowlock.Instance) -> str:
    return str(inst.data["customer"])


def _workflows() -> list[flowlock.Workflow]:
    """review: one review per reviewer at a time, two starts a minute per reviewer;
    sub: one live subscription per customer."""
    review = flowlock.Workflow(
        "review",
        states=["queued", flowlock.State("in_review", capacity=flowlock.Capacity(
            key=_reviewer, limit=1)), "done"],
        initial="queued",
        transitions=[
            flowlock.Transition("start", source="queued", target="in_review",
                                rate=flowlock.Rate(key=_reviewer, per=timedelta(minutes=1),
                                                   limit=2)),
            flowlock.Transition("finish", source="in_review", target="done"),
            flowlock.Transition("requeue", source="done", target="queued"),
        ],
    )  # fmt: skip
    sub = flowlock.Workflow(
        "sub",
        states=["active", "ended"],
        initial="active",
        transitions=[flowlock.Transition("end", source="active", target="ended")],
        unique=flowlock.Unique(key=_customer),
    )
    return [review, sub]


@pytest.fixture
async def svc() -> AsyncIterator[Service]:
    async with served(ServiceSettings(), workflows=_workflows()) as running:
        yield running


async def test_a_full_key_is_409_capacity_reached_and_writes_nothing(svc: Service) -> None:
    """The second reviewer's instance to enter is refused, naming the holder; nothing moved."""
    client = svc.client
    await create(client, "review", "a", reviewer="r")
    await create(client, "review", "b", reviewer="r")
    assert (await client.post("/instances/a/events/start")).status_code == 200
    before = await snapshot(client, "b")
    refused = await client.post("/instances/b/events/start")
    body = assert_problem(refused, 409, "capacity-reached")
    assert (body["kind"], body["key"], body["limit"], body["holders"]) == (CAP, "r", 1, ["a"])
    # version: the one the refused commit would have made.
    assert (body["instance_id"], body["version"], body["event"]) == ("b", 2, "start")
    assert await snapshot(client, "b") == before


async def test_get_capacity_shows_holders_limit_used_and_free(svc: Service) -> None:
    """GET /capacity/{kind}/{key}: the holders, oldest first, and what is left."""
    client = svc.client
    await create(client, "review", "a", reviewer="r/1")
    empty = await client.get("/capacity/review.in_review/r%2F1")
    assert empty.status_code == 200, empty.text
    assert empty.json() == {
        "kind": CAP, "key": "r/1", "limit": 1, "holders": [], "used": 0, "free": 1,
        "rule": "capacity", "window": None,
    }  # fmt: skip
    assert (await client.post("/instances/a/events/start")).status_code == 200
    held = (await client.get("/capacity/review.in_review/r%2F1")).json()
    assert (held["holders"], held["used"], held["free"]) == (["a"], 1, 0)
    rate = (await client.get("/capacity/review.start.rate/r%2F1")).json()
    assert (rate["rule"], rate["limit"], rate["window"], rate["holders"]) == (
        "rate", 2, 60.0, ["a"],
    )  # fmt: skip


async def test_an_unknown_kind_is_404(svc: Service) -> None:
    """A kind no rule or row knows: 404 constraint-not-found, listing the kinds served."""
    found = assert_problem(await svc.client.get("/capacity/nope/x"), 404, "constraint-not-found")
    assert CAP in found["known"] and "sub.unique" in found["known"]


async def test_a_second_holder_of_a_unique_key_is_409_unique_violation(svc: Service) -> None:
    """A create for a customer that has a live subscription is refused, naming it; none made."""
    client = svc.client
    await create(client, "sub", "s1", customer="c1")
    refused = await client.post(
        "/instances", json={"workflow": "sub", "id": "s2", "data": {"customer": "c1"}}
    )
    body = assert_problem(refused, 409, "unique-violation")
    assert (body["kind"], body["key"], body["holder"], body["holders"]) == (
        "sub.unique", "c1", "s1", ["s1"],
    )  # fmt: skip
    assert (await client.get("/instances/s2")).status_code == 404


async def test_a_rate_over_its_limit_is_429_with_retry_after(svc: Service) -> None:
    """The third start of a reviewer within a minute: 429, Retry-After whole seconds rounded up
    from the body's retry_after."""
    client = svc.client
    for name in ("a", "b"):
        await create(client, "review", name, reviewer="r")
    moves = [("a", "start"), ("a", "finish"), ("a", "requeue"), ("b", "start"), ("b", "finish")]
    for name, event in moves:
        assert (await client.post(f"/instances/{name}/events/{event}")).status_code == 200
    refused = await client.post("/instances/a/events/start")
    body = assert_problem(refused, 429, "rate-limited")
    assert (body["kind"], body["key"], body["limit"], body["per"]) == (
        "review.start.rate", "r", 2, 60.0,
    )  # fmt: skip
    assert 0 < body["retry_after"] <= 60
    assert refused.headers["retry-after"] == str(math.ceil(body["retry_after"]))


def test_the_capacity_route_is_a_read() -> None:
    """A read token may see a key's holders."""
    assert needed_scope("GET", "/capacity/review.in_review/r") == "read"
