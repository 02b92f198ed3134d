"""Configuring an engine: strategies as objects with presets by name, the lock backend, and the
composition root (``flowlock.connect``) that builds stores and lock backends from URLs."""

from __future__ import annotations

import pytest

import flowlock
from flowlock import examples
from flowlock.backends import build_locks, build_store
from flowlock.engine import connect
from flowlock.locks import MemoryLocks
from flowlock.stores import MemoryStore
from flowlock.strategies.adaptive import Adaptive
from flowlock.strategies.monitor import ConflictMonitor


class CountedLocks(MemoryLocks):
    """Memory locks that count how often they were opened and closed."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = self.closed = 0

    async def open(self) -> None:
        self.opened += 1

    async def aclose(self) -> None:
        self.closed += 1


def test_presets_by_name() -> None:
    """Without strategies=, every built-in name is there with its defaults; "distributed" only
    with a lock backend, leasing from it."""
    assert set(flowlock.Engine(MemoryStore()).strategies) == {
        "optimistic",
        "pessimistic",
        "adaptive",
    }
    locks = MemoryLocks()
    table = flowlock.Engine(MemoryStore(), locks=locks).strategies
    optimistic, pessimistic = table["optimistic"], table["pessimistic"]
    assert isinstance(optimistic, flowlock.Optimistic) and optimistic.max_attempts == 3
    assert isinstance(pessimistic, flowlock.Pessimistic) and pessimistic.lock_timeout == 5.0
    distributed = table["distributed"]
    assert isinstance(distributed, flowlock.Distributed) and distributed.locks is locks
    assert (distributed.ttl, distributed.wait, distributed.max_attempts) == (10.0, 5.0, 3)


def test_strategy_objects_replace_their_preset() -> None:
    """Objects given in strategies= replace the preset of their name; the adaptive preset is
    built from the optimistic strategy given."""
    opt, pes = flowlock.Optimistic(max_attempts=5), flowlock.Pessimistic(lock_timeout=1.0)
    eng = flowlock.Engine(MemoryStore(), strategies=[opt, pes], strategy="pessimistic")
    assert eng.strategies["optimistic"] is opt and eng.strategies["pessimistic"] is pes
    adaptive = eng.strategies["adaptive"]
    assert isinstance(adaptive, Adaptive)
    assert adaptive.optimistic is opt and adaptive.escalated is pes


async def test_a_distributed_without_backend_leases_from_the_engines() -> None:
    """Distributed(ttl=30) given with locks= on the engine is bound to that backend."""
    locks = MemoryLocks()
    eng = flowlock.Engine(MemoryStore(), locks=locks, strategies=[flowlock.Distributed(ttl=30)])
    distributed = eng.strategies["distributed"]
    assert isinstance(distributed, flowlock.Distributed)
    assert distributed.locks is locks and distributed.ttl == 30
    async with eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="r")
        out = await eng.fire("r", "approve", strategy="distributed")
    assert out.applied and out.strategy == "distributed"


async def test_a_distributed_backend_is_opened_and_closed_with_the_engine() -> None:
    """A Distributed with a backend of its own needs no locks=: it is the engine's backend, and
    the engine opens and closes it with the store."""
    locks = CountedLocks()
    eng = flowlock.Engine(MemoryStore(), strategies=[flowlock.Distributed(locks=locks)])
    assert eng.locks is locks
    async with eng:
        assert (locks.opened, locks.closed) == (1, 0)
    assert (locks.opened, locks.closed) == (1, 1)


def test_a_distributed_with_no_backend_anywhere_is_refused() -> None:
    """Distributed() with no backend, and none on the engine, is InvalidInput saying what to
    pass; so is a fire() with such a strategy object."""
    with pytest.raises(flowlock.InvalidInput, match=r"Distributed\(locks=\.\.\.\)"):
        flowlock.Engine(MemoryStore(), strategies=[flowlock.Distributed()])


async def test_a_per_call_distributed_needs_a_backend() -> None:
    """fire(strategy=Distributed()) on an engine without a lock backend is InvalidInput."""
    async with flowlock.Engine(MemoryStore()) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="r")
        with pytest.raises(flowlock.InvalidInput, match="no lock backend"):
            await eng.fire("r", "approve", strategy=flowlock.Distributed())
        assert (await eng.get("r")).version == 1


def test_two_backends_for_one_strategy_are_refused() -> None:
    """locks= and a Distributed's own, different backend: InvalidInput, give it once."""
    with pytest.raises(flowlock.InvalidInput, match="give the backend once"):
        flowlock.Engine(
            MemoryStore(),
            locks=MemoryLocks(),
            strategies=[flowlock.Distributed(locks=MemoryLocks())],
        )


@pytest.mark.parametrize("given", [["optimistic"], "optimistic", [object()], 3])
def test_strategies_takes_strategy_objects(given: object) -> None:
    """Names or anything else in strategies= are InvalidInput pointing at the objects (and at
    strategy= for naming the default)."""
    with pytest.raises(flowlock.InvalidInput, match=r"Strategy objects.*strategy="):
        flowlock.Engine(MemoryStore(), strategies=given)  # type: ignore[arg-type]


def test_one_strategy_per_name() -> None:
    """Two objects with the same name in strategies= are InvalidInput."""
    with pytest.raises(flowlock.InvalidInput, match="two strategies named 'optimistic'"):
        flowlock.Engine(
            MemoryStore(), strategies=[flowlock.Optimistic(), flowlock.Optimistic(max_attempts=9)]
        )


async def test_a_mapping_registers_a_strategy_under_another_name() -> None:
    """strategies={name: obj} adds obj under that name; a call may fire it by that name and the
    outcome records the strategy's own name."""
    fast = flowlock.Optimistic(max_attempts=1)
    async with flowlock.Engine(MemoryStore(), strategies={"fast": fast}) as eng:
        assert eng.strategies["fast"] is fast and "optimistic" in eng.strategies
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="r")
        out = await eng.fire("r", "approve", strategy="fast")
    assert out.applied and out.strategy == "optimistic"


def test_unknown_default_strategy() -> None:
    """strategy= names the default; an unknown name is InvalidInput listing the known ones."""
    eng = flowlock.Engine(MemoryStore(), strategy="pessimistic")
    assert eng.strategies["pessimistic"] is not None
    with pytest.raises(flowlock.InvalidInput, match="unknown default strategy 'locked'"):
        flowlock.Engine(MemoryStore(), strategy="locked")
    with pytest.raises(flowlock.InvalidInput, match="unknown default strategy 'distributed'"):
        flowlock.Engine(MemoryStore(), strategy="distributed")


def test_adaptive_needs_the_strategy_it_escalates_to() -> None:
    """A monitor escalating to "distributed" on an engine without locks is InvalidInput."""
    monitor = ConflictMonitor(escalate_to="distributed")
    with pytest.raises(flowlock.InvalidInput, match="locks="):
        flowlock.Engine(MemoryStore(), monitor=monitor)
    eng = flowlock.Engine(MemoryStore(), locks=MemoryLocks(), monitor=monitor)
    adaptive = eng.strategies["adaptive"]
    assert isinstance(adaptive, Adaptive) and adaptive.escalated.name == "distributed"


def test_a_given_adaptive_brings_its_monitor() -> None:
    """An Adaptive given in strategies= is the engine's (its monitor is the one shared); a
    different monitor= beside it is InvalidInput."""
    mine = ConflictMonitor(cooldown=1.0)
    adaptive = Adaptive(
        optimistic=flowlock.Optimistic(), escalated=flowlock.Pessimistic(), monitor=mine
    )
    eng = flowlock.Engine(MemoryStore(), strategies=[adaptive])
    assert eng.monitor is mine and eng.strategies["adaptive"] is adaptive
    with pytest.raises(flowlock.InvalidInput, match="two different monitors"):
        flowlock.Engine(MemoryStore(), strategies=[adaptive], monitor=ConflictMonitor())


# -- connect ------------------------------------------------------------------------


async def test_connect_builds_the_store_and_the_lock_backend() -> None:
    """connect("memory://", locks="memory") has a distributed strategy on memory locks; a
    Distributed() given without a backend leases from it."""
    eng = flowlock.Engine.connect(
        "memory://", locks="memory", strategies=[flowlock.Distributed(ttl=3)]
    )
    assert isinstance(eng.store, MemoryStore) and isinstance(eng.locks, MemoryLocks)
    distributed = eng.strategies["distributed"]
    assert isinstance(distributed, flowlock.Distributed)
    assert distributed.locks is eng.locks and distributed.ttl == 3
    assert connect("memory://").locks is None


def test_build_locks_builds_each_kind() -> None:
    """One factory for every lock backend; nothing is connected until open()."""
    from flowlock.locks.redis import RedisLocks

    assert isinstance(build_locks("memory"), MemoryLocks)
    assert isinstance(build_locks("redis", redis_url="redis://127.0.0.1:1/0"), RedisLocks)
    advisory = pytest.importorskip("flowlock.locks.advisory")
    built = build_locks("advisory", database_url="postgresql://u@h/db", schema="s", pool_size=3)
    assert isinstance(built, advisory.AdvisoryLocks) and built.pool_size == 3


@pytest.mark.parametrize(
    ("kind", "options", "match"),
    [
        ("redis", {}, "redis_url="),
        ("advisory", {"database_url": "sqlite:///x.db"}, "postgresql://"),
        ("advisory", {}, "postgresql://"),
        ("zookeeper", {}, '"redis", "advisory" or "memory"'),
    ],
)
def test_build_locks_says_what_is_missing(kind: str, options: dict[str, str], match: str) -> None:
    """A lock backend that cannot be built is InvalidInput saying what to pass."""
    with pytest.raises(flowlock.InvalidInput, match=match):
        build_locks(kind, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["mysql://u@h/db", 42])
def test_build_store_refuses_unknown_urls(url: object) -> None:
    """Only PostgreSQL, SQLite and memory URLs make a store."""
    with pytest.raises(flowlock.InvalidInput):
        build_store(url)  # type: ignore[arg-type]


class _LosingStore(MemoryStore):
    """A memory store whose compare-and-swaps lose, as if another process wrote first."""

    async def commit(self, entries):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize(("retries", "attempts"), [(0, 1), (1, 2), (2, 3)])
async def test_adaptive_finishes_under_the_lock_after_its_retries(
    retries: int, attempts: int
) -> None:
    """A call on a calm instance that loses its compare-and-swap retries `retries_before_lock`
    times, then finishes under the escalated strategy: applied, never ConflictRetriesExhausted,
    its optimistic attempts counted in its attempts."""
    monitor = ConflictMonitor()
    adaptive = Adaptive(
        optimistic=flowlock.Optimistic(backoff_base=0.0),
        escalated=flowlock.Pessimistic(),
        monitor=monitor,
        retries_before_lock=retries,
    )
    async with flowlock.Engine(_LosingStore(), strategies=[adaptive], batching=False) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="a")
        out = await eng.fire("a", "approve", strategy="adaptive")
    assert out.applied and out.strategy == "pessimistic"
    assert out.attempts == attempts + 1
    assert out.reason is not None and f"lost its compare-and-swap {attempts} time" in out.reason


async def test_adaptive_takes_the_lock_without_a_backoff_when_no_attempt_is_left() -> None:
    """With one optimistic attempt, a lost compare-and-swap goes straight to the lock: no
    backoff and no read that nothing would use."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    adaptive = Adaptive(
        optimistic=flowlock.Optimistic(max_attempts=1, sleep=sleep),
        escalated=flowlock.Pessimistic(),
        monitor=ConflictMonitor(),
    )
    async with flowlock.Engine(_LosingStore(), strategies=[adaptive], batching=False) as eng:
        await eng.register(examples.approval())
        await eng.create("approval", instance_id="a")
        out = await eng.fire("a", "approve", strategy="adaptive")
    assert out.applied and out.strategy == "pessimistic" and out.attempts == 2
    assert slept == []


def test_adaptive_refuses_a_bad_retries_before_lock() -> None:
    for bad in (-1, 1.5, True, 1001):
        with pytest.raises(flowlock.InvalidInput, match="retries_before_lock"):
            Adaptive(
                optimistic=flowlock.Optimistic(),
                escalated=flowlock.Pessimistic(),
                monitor=ConflictMonitor(),
                retries_before_lock=bad,  # type: ignore[arg-type]
            )
