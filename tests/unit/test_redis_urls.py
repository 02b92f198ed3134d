"""Redis URLs for one server, Redis Sentinel and Redis Cluster: taken apart in one place, and
every malformed one refused with InvalidInput saying what is wrong and how to write it, before
any I/O (and without quoting a password). Also the unavailability window's bookkeeping."""

from __future__ import annotations

import math

import pytest

import flowlock
from flowlock.core.errors import InvalidInput
from flowlock.locks.redis import RedisLocks
from flowlock.locks.redis.urls import RedisAddress, parse
from flowlock_lab.unavailability import Availability


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "rediss://h/1", "unix:///tmp/redis.sock?db=2", "REDIS://h"],
)
def test_one_server_urls_are_left_to_redis_py(url: str) -> None:
    address = parse(url)
    assert address == RedisAddress("single", url)


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    address = parse(
        "redis+sentinel://user:p%40ss@10.0.0.1:26380,sentinel-b,[::1]:26381/mymaster/3"
        "?sentinel_password=s3cret&client_name=billing"
    )
    assert address.kind == "sentinel"
    assert address.hosts == (("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 26381))
    assert (address.service_name, address.db) == ("mymaster", 3)
    assert (address.username, address.password) == ("user", "p@ss")
    assert (address.sentinel_username, address.sentinel_password) == (None, "s3cret")
    assert address.client_name == "billing"
    assert "p@ss" not in repr(address) and "s3cret" not in repr(address)


@pytest.mark.parametrize(
    ("url", "service", "db", "password"),
    [
        ("redis+sentinel://h/svc", "svc", 0, None),
        ("redis+sentinel://h/svc/", "svc", 0, None),
        ("redis+sentinel://h?service_name=svc", "svc", 0, None),
        ("redis+sentinel://h/2?service_name=svc", "svc", 2, None),
        ("redis+sentinel://secret@h/svc", "svc", 0, "secret"),
        ("redis+sentinel://:secret@h/svc", "svc", 0, "secret"),
    ],
)
def test_sentinel_url_forms(url: str, service: str, db: int, password: str | None) -> None:
    address = parse(url)
    assert (address.service_name, address.db, address.password) == (service, db, password)


def test_a_cluster_url_names_its_startup_nodes() -> None:
    address = parse("redis+cluster://:pw@n1:7000,n2,n3:7002/0?client_name=x")
    assert address.kind == "cluster"
    assert address.hosts == (("n1", 7000), ("n2", 6379), ("n3", 7002))
    assert (address.password, address.client_name) == ("pw", "x")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h1,h2", "names no service"),
        ("redis+sentinel:///svc", "names no host"),
        ("redis+sentinel://h1,,h2/svc", "empty entry"),
        ("redis+sentinel://h:port/svc", "port of 'h:port'"),
        ("redis+sentinel://h:70000/svc", "from 1 to 65535"),
        ("redis+sentinel://:26379/svc", "no host"),
        ("redis+sentinel://[::1/svc", "cannot be read"),
        ("redis+sentinel://h/svc/db", "not a whole number"),
        ("redis+sentinel://h/svc/1/2", "more than /service_name/db"),
        ("redis+sentinel://h/svc?service_name=other", "both in its path"),
        ("redis+sentinel://h/svc?timeout=3", "?timeout= is not a setting"),
        ("redis+sentinel://h/svc?client_name=a&client_name=b", "given twice"),
        ("redis+sentinel://h/svc?client_name=", "is empty"),
        ("redis+sentinel://h/svc#x", "fragment"),
        ("redis+cluster://n1:7000/1", "database 0 only"),
        ("redis+cluster://n1:7000?service_name=x", "?service_name= is not a setting"),
        ("redis+cluster://", "names no host"),
    ],
)
def test_malformed_urls_are_refused_saying_why(url: str, says: str) -> None:
    with pytest.raises(InvalidInput, match="malformed") as caught:
        parse(url)
    assert says in str(caught.value)
    assert "write it as" in str(caught.value)


def test_a_refusal_never_quotes_the_password() -> None:
    with pytest.raises(InvalidInput) as caught:
        parse("redis+sentinel://:hunter2@h:bad/svc")
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    "url", ["http://h", "sentinel://h/svc", "redis+socket://x", "h:6379", "", 42, None]
)
def test_other_schemes_and_non_urls_are_refused(url: object) -> None:
    with pytest.raises(InvalidInput):
        parse(url)


def test_every_entry_point_refuses_a_malformed_url_before_any_io() -> None:
    """RedisLocks and Engine.connect both check through the one parser."""
    with pytest.raises(InvalidInput, match="names no service"):
        RedisLocks("redis+sentinel://127.0.0.1:1")
    with pytest.raises(InvalidInput, match="database 0 only"):
        flowlock.Engine.connect("memory://", redis_url="redis+cluster://127.0.0.1:1/2")


def test_well_formed_sentinel_and_cluster_urls_build_an_engine_without_io() -> None:
    for url in ("redis+sentinel://127.0.0.1:1/svc", "redis+cluster://127.0.0.1:1"):
        engine = flowlock.Engine.connect("memory://", redis_url=url)
        assert isinstance(engine.locks, RedisLocks)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_window_runs_from_the_fault_to_the_first_success_begun_after_it() -> None:
    clock = Clock()
    seen = Availability(clock)
    assert seen.window() == 0.0 and not seen.recovered()
    clock.now = 1.0
    seen.ok(began=0.5)
    clock.now = 2.0
    seen.fault()
    assert seen.window() == math.inf
    clock.now = 2.5
    seen.ok(began=1.9)  # began before the fault: may have used the server while it was alive
    assert not seen.recovered()
    clock.now = 4.25
    seen.ok(began=3.0)
    clock.now = 5.0
    seen.ok(began=2.1)  # began earlier, ended later: the first to end counts
    assert seen.recovered() and seen.window() == 2.25
    assert seen.successes == 4
