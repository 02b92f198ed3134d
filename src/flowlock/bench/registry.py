"""The strategies the benchmark can run, by name; tests and plugins can add more.

`raw` is the floor. `ALIASES` are command-line names that stand for several.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowlock.core.errors import InvalidInput
from flowlock.locks.base import LockBackend
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

__all__ = [
    "ALIASES",
    "DEFAULT_STRATEGIES",
    "LEASE_TTL",
    "LEASE_WAIT",
    "STRATEGIES",
    "BuildContext",
    "StrategySpec",
    "expand",
    "register_strategy",
]

LEASE_TTL = 10.0
LEASE_WAIT = 5.0
"""The distributed strategies' lease: ttl and the bound on waiting for it (seconds)."""


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a strategy is built from: the pair's random source and its lock backend.

    The random source is seeded per run, so `--seed` reproduces the jitter.
    """

    rng: random.Random
    locks: LockBackend | None = None


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """A concurrency strategy the benchmark can run.

    `build` makes a fresh strategy for one pair. None means the engine's own strategy
    of that name (`adaptive`). `locks` names the lock backend it needs.
    `floor` marks the raw-asyncpg floor, which is not a flowlock strategy.
    """

    name: str
    summary: str
    build: Callable[[BuildContext], Strategy] | None = None
    locks: str | None = None
    floor: bool = False


STRATEGIES: dict[str, StrategySpec] = {}
"""Every strategy the benchmark knows, by name, in the order it runs them."""

ALIASES: dict[str, tuple[str, ...]] = {"distributed": ("distributed-redis", "distributed-advisory")}
"""Names that stand for several strategies on the command line."""


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add `spec` to `STRATEGIES` (replacing one of the same name)."""
    STRATEGIES[spec.name] = spec
    return spec


def expand(names: Sequence[str]) -> tuple[str, ...]:
    """`names` with aliases expanded and duplicates dropped, in first-mention order."""
    out: list[str] = []
    for name in names:
        out.extend(ALIASES.get(name, (name,)))
    return tuple(dict.fromkeys(out))


def _distributed(ctx: BuildContext) -> Strategy:
    if ctx.locks is None:  # pragma: no cover - the runner always passes the backend it named
        raise InvalidInput("the distributed strategy needs a lock backend")
    return Distributed(locks=ctx.locks, ttl=LEASE_TTL, wait=LEASE_WAIT)


register_strategy(
    StrategySpec(
        "raw",
        "the floor: bare asyncpg, fewest statements, no engine (see flowlock.bench.raw)",
        floor=True,
    )
)
register_strategy(
    StrategySpec(
        "optimistic",
        "version compare-and-swap, 3 attempts, jittered backoff",
        lambda ctx: Optimistic(rng=ctx.rng),
    )
)
register_strategy(
    StrategySpec(
        "pessimistic",
        "row lock (SELECT ... FOR UPDATE) with a 5 s lock_timeout",
        lambda ctx: Pessimistic(),
    )
)
register_strategy(
    StrategySpec(
        "distributed-redis",
        "a Redis lease per instance (10 s ttl, 5 s wait), then a fenced compare-and-swap",
        _distributed,
        locks="redis",
    )
)
register_strategy(
    StrategySpec(
        "distributed-advisory",
        "a PostgreSQL advisory-lock lease per instance, then a fenced compare-and-swap",
        _distributed,
        locks="advisory",
    )
)
if importlib.util.find_spec("flowlock.strategies.adaptive") is not None:
    register_strategy(
        StrategySpec(
            "adaptive",
            "optimistic; an instance over 5 % conflicts escalates to the row lock",
        )
    )

DEFAULT_STRATEGIES: tuple[str, ...] = tuple(STRATEGIES)
"""What `flowlock bench` runs when no `strategy` is given: every registered strategy."""
