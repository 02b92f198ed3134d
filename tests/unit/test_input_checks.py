"""Every public constructor and call refuses a bad number, string or argument with InvalidInput
naming the parameter, before any I/O: NaN, infinities, negatives, bools where a number is meant,
absurd ceilings, NUL characters and lone surrogates, wrong types. Constructors open nothing, so
the PostgreSQL and Redis adapters are checked here too (tests/integration/test_input_checks_io.py
shows on the real servers that nothing was opened or written).

Before these checks, NaN passed every ``x < 0`` test (AdvisoryLocks' io_timeout became 1 ms on
the server), "5" raised a raw TypeError, a NUL lock key reached the advisory backend's fencing
insert, and a lone surrogate in an instance id was a raw UnicodeEncodeError on SQLite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.core.jsondata import MAX_INT_BITS, MAX_PAYLOAD
from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis
from flowlock.engine import connect
from flowlock.locks import MemoryLocks
from flowlock.locks.advisory import AdvisoryLocks
from flowlock.locks.redis import RedisLocks
from flowlock.metrics import Metrics
from flowlock.stores import MemoryStore
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore
from flowlock.strategies.monitor import ConflictMonitor

PG = "postgresql://postgres@127.0.0.1:1/none"  # never connected to: every case fails first
REDIS = "redis://127.0.0.1:1/0"

# Numbers that are never a count of seconds, connections or attempts.
NOT_A_NUMBER = [math.nan, math.inf, -math.inf, True, "5", None, [1]]
# Strings no store can hold (or no name can be).
NOT_TEXT = ["", "a\x00b", "a\ud800", 5, None]

Make = Callable[[Any], object]

# (parameter, how to pass a value for it, the bad values beyond NOT_A_NUMBER / NOT_TEXT)
SECONDS: list[tuple[str, Make, list[Any]]] = [
    ("acquire_timeout", lambda v: PostgresStore(PG, acquire_timeout=v), [0, -1, 1e9]),
    ("connect_timeout", lambda v: PostgresStore(PG, connect_timeout=v), [0, -1, 1e9]),
    ("lock_timeout", lambda v: PostgresStore(PG, lock_timeout=v), [0, -1, 1e9]),
    ("command_timeout", lambda v: PostgresStore(PG, command_timeout=v), [0, -1, 1e9]),
    ("pool_timeout", lambda v: AdvisoryLocks(PG, pool_timeout=v), [-1, 1e9]),
    ("io_timeout", lambda v: AdvisoryLocks(PG, io_timeout=v), [0, -1, 1e9]),
    ("connect_timeout", lambda v: AdvisoryLocks(PG, connect_timeout=v), [0, -1, 1e9]),
    ("socket_timeout", lambda v: RedisLocks(REDIS, socket_timeout=v), [0, -1, 1e9]),
    ("busy_timeout", lambda v: SqliteStore(":memory:", busy_timeout=v), [-1, 1e9]),
    ("acquire_timeout", lambda v: SqliteStore(":memory:", acquire_timeout=v), [0, -1, 1e9]),
    ("lock_timeout", lambda v: MemoryStore(lock_timeout=v), [0, -1, 1e9]),
    ("backoff_base", lambda v: flowlock.Optimistic(backoff_base=v), [-1, 1e9]),
    ("backoff_cap", lambda v: flowlock.Optimistic(backoff_cap=v), [-1, 1e9]),
    ("lock_timeout", lambda v: flowlock.Pessimistic(lock_timeout=v), [0, -1, 1e9]),
    ("lock_timeout", lambda v: flowlock.Pessimistic(lock_timeout=v, nowait=True), [-1]),
    ("ttl", lambda v: flowlock.Distributed(ttl=v), [0, -1, 1e9]),
    ("wait", lambda v: flowlock.Distributed(wait=v), [-1, 1e9]),
    ("ttl", lambda v: flowlock.RunOnce(MemoryLocks(), PG, ttl=v), [0, -1, 1e9]),
    ("wait", lambda v: flowlock.RunOnce(MemoryLocks(), PG, wait=v), [-1, 1e9]),
    ("acquire_timeout", lambda v: flowlock.RunOnce(MemoryLocks(), PG, acquire_timeout=v), [0]),
    ("command_timeout", lambda v: flowlock.RunOnce(MemoryLocks(), PG, command_timeout=v), [0]),
    ("window_seconds", lambda v: ConflictMonitor(window_seconds=v), [0, -1, 1e9]),
    ("cooldown", lambda v: ConflictMonitor(cooldown=v), [0, -1, 1e9]),
    ("escalation_sync", lambda v: flowlock.Engine(MemoryStore(), escalation_sync=v), [0, -1]),
    ("escalation_sync", lambda v: connect("memory://", escalation_sync=v), [0, -1]),
    ("start_timeout", lambda v: EmbeddedPostgres(start_timeout=v), [0, -1, 1e9]),
    ("stop_timeout", lambda v: EmbeddedRedis(stop_timeout=v), [0, -1, 1e9]),
]
COUNTS: list[tuple[str, Make, list[Any]]] = [
    ("pool_size", lambda v: PostgresStore(PG, pool_size=v), [0, -1, 1.5, 10**12]),
    ("min_size", lambda v: PostgresStore(PG, min_size=v), [-1, 1.5, 10**12]),
    ("pool_size", lambda v: AdvisoryLocks(PG, pool_size=v), [0, -1, 1.5, 10**12]),
    ("max_connections", lambda v: RedisLocks(REDIS, max_connections=v), [1, 1.5, 10**12]),
    ("fence_gap", lambda v: RedisLocks(REDIS, fence_gap=v), [-1, 1.5, 2**63]),
    ("pool_size", lambda v: SqliteStore(":memory:", pool_size=v), [0, 1.5, 10**6]),
    ("pool_size", lambda v: flowlock.RunOnce(MemoryLocks(), PG, pool_size=v), [0, 10**12]),
    ("max_attempts", lambda v: flowlock.Optimistic(max_attempts=v), [0, -1, 2.0, 10**6]),
    ("max_attempts", lambda v: flowlock.Distributed(max_attempts=v), [0, 2.0, 10**6]),
    ("window", lambda v: ConflictMonitor(window=v), [0, 2.0, 10**12]),
    ("min_samples", lambda v: ConflictMonitor(min_samples=v), [0, 2.0, 10**6]),
    ("max_keys", lambda v: ConflictMonitor(max_keys=v), [0, 2.0, 10**12]),
    (
        "max_payload_bytes",
        lambda v: flowlock.Engine(MemoryStore(), max_payload_bytes=v),
        [1, 2.0, MAX_PAYLOAD + 1],
    ),
    ("max_payload_bytes", lambda v: connect("memory://", max_payload_bytes=v), [1, 10**12]),
    ("max_size", lambda v: connect(PG, max_size=v), [0, 10**12]),
    ("max_connections", lambda v: EmbeddedPostgres(max_connections=v), [3, 10**12]),
]
RATES: list[tuple[str, Make, list[Any]]] = [
    ("threshold", lambda v: ConflictMonitor(threshold=v), [0, 1, -0.5, 2]),
    ("z", lambda v: ConflictMonitor(z=v), [-1, 1e9]),
]
TEXTS: list[tuple[str, Make, list[Any]]] = [
    ("dsn", lambda v: PostgresStore(v), ["mysql://x", "no scheme"]),
    ("dsn", lambda v: AdvisoryLocks(v), ["redis://x"]),
    ("dsn", lambda v: flowlock.RunOnce(MemoryLocks(), v), ["sqlite:///x"]),
    ("Redis URL", lambda v: RedisLocks(v), ["http://x"]),
    ("namespace", lambda v: AdvisoryLocks(PG, namespace=v), ["n" * 201]),
    ("namespace", lambda v: RedisLocks(REDIS, namespace=v), ["n" * 201]),
    ("application_name", lambda v: AdvisoryLocks(PG, application_name=v), ["é"]),
    ("schema", lambda v: PostgresStore(PG, schema=v), ["Public", "a;b"]),
    ("schema", lambda v: connect(PG, schema=v), ["a b"]),
    ("owner", lambda v: flowlock.RunOnce(MemoryLocks(), PG, owner=v), ["a\nb"]),
    ("escalate_to", lambda v: ConflictMonitor(escalate_to=v), []),
    ("shared_buffers", lambda v: EmbeddedPostgres(shared_buffers=v), []),
    ("prefix", lambda v: Metrics(prefix=v), ["1abc", "a-b"]),
]


# Where None means "the default" rather than a bad value.
OPTIONAL = {"max_size", "schema", "owner"}


def _cases(table: list[tuple[str, Make, list[Any]]], common: list[Any]) -> list[Any]:
    return [
        pytest.param(name, make, value, id=f"{name}={value!r}-{i}")
        for i, (name, make, extra) in enumerate(table)
        for value in [*common, *extra]
        if not (value is None and name in OPTIONAL)
    ]


def _refused(name: str, make: Make, value: Any) -> None:
    with pytest.raises(flowlock.InvalidInput) as caught:
        make(value)
    assert name in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("name", "make", "value"), _cases(SECONDS, NOT_A_NUMBER))
def test_bad_seconds_are_refused_by_every_constructor(name: str, make: Make, value: Any) -> None:
    """A timeout, ttl, wait or interval: a finite number of seconds in its range, or
    InvalidInput naming it (NaN, infinities, bools, text, None, negatives, a unit mistake)."""
    _refused(name, make, value)


@pytest.mark.parametrize(("name", "make", "value"), _cases(COUNTS, NOT_A_NUMBER))
def test_bad_counts_are_refused_by_every_constructor(name: str, make: Make, value: Any) -> None:
    """A size, a count of attempts, keys or bytes: a whole number (not a bool, not a float) in
    its range, or InvalidInput naming it."""
    _refused(name, make, value)


@pytest.mark.parametrize(("name", "make", "value"), _cases(RATES, NOT_A_NUMBER))
def test_bad_rates_are_refused(name: str, make: Make, value: Any) -> None:
    """The adaptive monitor's threshold (a rate strictly between 0 and 1) and z (a finite
    number of standard deviations, 0 or more)."""
    _refused(name, make, value)


@pytest.mark.parametrize(("name", "make", "value"), _cases(TEXTS, NOT_TEXT))
def test_bad_names_and_urls_are_refused_by_every_constructor(
    name: str, make: Make, value: Any
) -> None:
    """URLs, namespaces, schemas, owners and names: a str, not empty, no NUL, no lone
    surrogate, of the right shape; or InvalidInput naming the parameter."""
    _refused(name, make, value)


def test_a_url_in_a_message_shows_its_scheme_only() -> None:
    """A refused URL may carry a password: the message names its scheme, never the rest."""
    with pytest.raises(flowlock.InvalidInput) as caught:
        PostgresStore("mysql://user:s3cret@host/db")
    assert "s3cret" not in str(caught.value) and "mysql://" in str(caught.value)


def test_settings_of_an_embedded_server_are_one_line_each() -> None:
    """A newline in a setting would write a second, unchecked line into postgresql.conf."""
    with pytest.raises(flowlock.InvalidInput, match="settings"):
        EmbeddedPostgres(settings={"work_mem": "4MB\nfsync = off"})
    with pytest.raises(flowlock.InvalidInput, match="settings"):
        EmbeddedRedis(settings={"bad name": "1"})
    assert EmbeddedRedis(settings={"save": ""})  # an empty value is a value


def test_two_metrics_on_one_registry_are_invalid_input() -> None:
    """prometheus_client's raw ValueError for a name taken becomes InvalidInput saying what to
    do."""
    first = Metrics()
    with pytest.raises(flowlock.InvalidInput, match="own registry or prefix"):
        Metrics(first.registry)
    assert Metrics(first.registry, prefix="other").registry is first.registry


# -- lock keys: the same rule on every backend ---------------------------------------------

BAD_KEYS = ["", "k\x00", "k\ud800", "k" * 513, 5, None]
BAD_TTL = [math.nan, math.inf, 0, -1, True, "5", None, 3601]
BAD_WAIT = [math.nan, math.inf, -1, True, "5", None, 3601]


def _backends() -> list[Any]:
    return [MemoryLocks(), RedisLocks(REDIS), AdvisoryLocks(PG)]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_bad_lock_keys_are_refused_by_every_backend_before_any_io(key: Any) -> None:
    """NUL, a lone surrogate, empty, over 512 characters, not a str: refused when acquire() is
    called, by every backend (they are closed here: any I/O would raise EngineClosed)."""
    for locks in _backends():
        with pytest.raises(flowlock.InvalidInput, match="lock key"):
            locks.acquire(key, ttl=1)
        with pytest.raises(flowlock.InvalidInput, match="lock key"):
            await locks.wait_released(key, 1)
        with pytest.raises(flowlock.InvalidInput, match="lock key"):
            await locks.locked(key)


@pytest.mark.parametrize("ttl", BAD_TTL)
def test_bad_ttls_are_refused_by_every_backend(ttl: Any) -> None:
    for locks in _backends():
        with pytest.raises(flowlock.InvalidInput, match="ttl"):
            locks.acquire("k", ttl=ttl)


@pytest.mark.parametrize("wait", BAD_WAIT)
async def test_bad_waits_are_refused_by_every_backend(wait: Any) -> None:
    for locks in _backends():
        with pytest.raises(flowlock.InvalidInput, match="wait"):
            locks.acquire("k", ttl=1, wait=wait)
        with pytest.raises(flowlock.InvalidInput, match="wait"):
            await locks.wait_released("k", wait)


async def test_a_bad_extension_is_refused_and_the_lease_kept() -> None:
    locks = MemoryLocks()
    lease = await locks.acquire("k", ttl=5)
    for ttl in (math.nan, -1, True, 10**9):
        with pytest.raises(flowlock.InvalidInput, match="ttl"):
            await locks.extend(lease, ttl)
    assert await locks.owned(lease)


# -- RunOnce.run ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "tick", "name"),
    [
        ("", 1, "job"),
        ("j\x00", 1, "job"),
        ("j\ud800", 1, "job"),
        ("j", "t\x00", "tick"),
        ("j", True, "tick"),
        ("j", "", "tick"),
        ("j" * 201, 1, "job"),
    ],
)
async def test_bad_jobs_and_ticks_are_refused_before_any_io(job: Any, tick: Any, name: str) -> None:
    """RunOnce is not opened: a call that got past its checks would raise EngineClosed."""

    async def never(ctx: object) -> None:  # pragma: no cover - never runs
        raise AssertionError("ran")

    runner = flowlock.RunOnce(MemoryLocks(), PG)
    with pytest.raises(flowlock.InvalidInput, match=name):
        await runner.run(job, tick, never)


# -- engine calls: refused before anything is read, nothing changed --------------------------

BAD_IDS = ["", "i\x00", "i\ud800", "i\n", "i" * 201, 5, None]


@pytest.fixture
async def engine() -> Any:
    async with flowlock.Engine(MemoryStore()) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="i")
        yield eng


@pytest.mark.parametrize("bad", BAD_IDS)
async def test_bad_ids_are_refused_by_every_call_and_change_nothing(
    engine: flowlock.Engine, bad: Any
) -> None:
    """instance_id, actor and request_id: what every store can hold, or InvalidInput naming the
    argument; a refused create creates nothing, a refused fire leaves the version as it was."""
    with pytest.raises(flowlock.InvalidInput, match="instance_id"):
        await engine.create("approval", instance_id=bad)
    assert (await engine.count(workflow="approval")) == 1
    for call in (engine.get, engine.history):
        with pytest.raises(flowlock.InvalidInput, match="instance_id"):
            await call(bad)
    with pytest.raises(flowlock.InvalidInput, match="instance_id"):
        await engine.fire(bad, "approve")
    if bad is not None:  # None is "no actor" / "no request id"
        for name in ("actor", "request_id"):
            with pytest.raises(flowlock.InvalidInput, match=name):
                await engine.fire("i", "approve", **{name: bad})
    inst = await engine.get("i")
    assert (inst.version, inst.state) == (1, "pending")
    assert await engine.history("i") == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "1", math.nan])
async def test_a_bad_expected_version_changes_nothing(engine: flowlock.Engine, bad: Any) -> None:
    with pytest.raises(flowlock.InvalidInput, match="expected_version"):
        await engine.fire("i", "approve", expected_version=bad)
    assert (await engine.get("i")).version == 1


# Built when the test runs: pytest prints parameters, and Python refuses to print 5000 digits.
PAYLOADS: dict[str, Callable[[], Any]] = {
    "nan deep in a list": lambda: {"x": [1, [2, {"y": math.nan}]]},
    "int over a double": lambda: {"x": 2**MAX_INT_BITS},
    # Python's own json.dumps raised a raw ValueError on this one.
    "5000 digits": lambda: {"x": -(10**5000)},
    "tuple key": lambda: {("a",): 1},
    "surrogate": lambda: {"k": "\ud800"},
}


@pytest.mark.parametrize("case", list(PAYLOADS))
async def test_bad_payloads_change_nothing(engine: flowlock.Engine, case: str) -> None:
    with pytest.raises(flowlock.InvalidInput, match="payload"):
        await engine.fire("i", "approve", payload=PAYLOADS[case]())
    assert (await engine.get("i")).version == 1
