"""A constraint's refusal over HTTP: 409 capacity-reached and unique-violation, 429
rate-limited with Retry-After in whole seconds rounded up; each body names the kind, key, limit
and the holders (or the holder) a client acts on."""

from __future__ import annotations

from flowlock.core.constraints import CapacityReached, RateLimited, UniqueViolation
from flowlock.http import PROBLEM_JSON, problem

PATH = "/instances/a/events/start"


def test_capacity_reached_is_409_with_its_holders() -> None:
    """capacity-reached: kind, key, limit, holders, and the refused call's version and event."""
    exc = CapacityReached(
        instance_id="a", kind="review.in_review", key="r", limit=2, holders=["b", "c"],
        version=2, event="start",
    )  # fmt: skip
    status, body, headers = problem(exc, PATH)
    assert status == 409 and headers == {"Content-Type": PROBLEM_JSON}
    assert body["type"] == "urn:flowlock:problem:capacity-reached"
    assert {k: body[k] for k in ("kind", "key", "limit", "holders", "instance_id", "version")} == {
        "kind": "review.in_review", "key": "r", "limit": 2, "holders": ["b", "c"],
        "instance_id": "a", "version": 2,
    }  # fmt: skip
    assert body["event"] == "start" and "'r'" in body["detail"]


def test_unique_violation_is_409_naming_the_holder() -> None:
    """unique-violation: the one holder, as `holder` and as `holders`; a create's version is 1."""
    exc = UniqueViolation(instance_id="s2", kind="sub.unique", key="c1", holder="s1", version=1)
    status, body, _ = problem(exc, "/instances")
    assert status == 409 and body["type"] == "urn:flowlock:problem:unique-violation"
    assert (body["holder"], body["holders"], body["limit"]) == ("s1", ["s1"], 1)
    assert (body["kind"], body["key"], body["version"], body["event"]) == (
        "sub.unique", "c1", 1, None,
    )  # fmt: skip
    assert "'s1'" in body["detail"]


def test_rate_limited_is_429_with_retry_after_rounded_up() -> None:
    """rate-limited: Retry-After in whole seconds, never early; the exact seconds in the body."""
    exc = RateLimited(
        instance_id="o1", kind="order.place.rate", key="sku-1", limit=20, per=60.0,
        retry_after=2.2, version=3, event="place",
    )  # fmt: skip
    status, body, headers = problem(exc, PATH)
    assert status == 429 and body["type"] == "urn:flowlock:problem:rate-limited"
    assert headers["Retry-After"] == "3"
    assert (body["retry_after"], body["per"], body["limit"]) == (2.2, 60.0, 20)
    assert (body["kind"], body["key"]) == ("order.place.rate", "sku-1")
    whole = RateLimited(instance_id="o1", kind="k", key="x", limit=1, per=1.0, retry_after=4.0)
    assert problem(whole)[2]["Retry-After"] == "4"
