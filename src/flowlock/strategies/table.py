"""The strategy table: the strategies an engine runs, by name, with the presets filled in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from flowlock.core.errors import InvalidInput
from flowlock.locks.base import LockBackend
from flowlock.strategies.adaptive import Adaptive
from flowlock.strategies.base import Strategy
from flowlock.strategies.distributed import Distributed
from flowlock.strategies.monitor import ConflictMonitor
from flowlock.strategies.optimistic import Optimistic
from flowlock.strategies.pessimistic import Pessimistic

__all__ = [
    "StrategyConfig",
    "StrategyTable",
    "batchable",
    "given",
    "unknown_strategy",
    "with_bounds",
]

StrategyConfig: TypeAlias = Sequence[Strategy] | Mapping[str, Strategy]
"""``strategies=``: Strategy objects under their ``.name``, or a mapping of names to them."""


def batchable(strategy: Strategy) -> bool:
    """Whether the engine may run ``strategy`` over a batch.

    flowlock's own strategies hand what they plan to the store as it is; an application's may not.
    """
    if isinstance(strategy, Adaptive):
        return batchable(strategy.escalated)
    return isinstance(strategy, Optimistic | Pessimistic | Distributed)


def given(strategies: StrategyConfig | None) -> dict[str, Strategy]:
    """``strategies=`` as a table by name, each entry checked to be a Strategy."""
    if strategies is None:
        return {}
    if isinstance(strategies, str) or not isinstance(strategies, Sequence | Mapping):
        raise InvalidInput(
            "strategies takes Strategy objects, e.g. strategies=[flowlock.Optimistic("
            f"max_attempts=5)], not {strategies!r}; choose the default by name with strategy=..."
        )
    pairs = (
        list(strategies.items())
        if isinstance(strategies, Mapping)
        else [(getattr(s, "name", None), s) for s in strategies]
    )
    table: dict[str, Strategy] = {}
    for name, given in pairs:
        if not isinstance(given, Strategy) or not isinstance(name, str):
            raise InvalidInput(
                f"strategies takes Strategy objects such as flowlock.Optimistic(max_attempts=5) "
                f"or flowlock.Pessimistic(lock_timeout=1.0), not {given!r}; name the default "
                "with strategy='pessimistic'"
            )
        if name in table:
            raise InvalidInput(f"two strategies named {name!r} in strategies=; give one")
        table[name] = given
    return table


@dataclass(frozen=True, slots=True)
class StrategyTable:
    """What an engine runs: strategies by name, its lock backend and the adaptive monitor."""

    strategies: Mapping[str, Strategy]
    locks: LockBackend | None
    backends: tuple[LockBackend, ...]
    """Every lock backend the engine opens and closes, each once."""
    monitor: ConflictMonitor

    @classmethod
    def build(
        cls,
        strategies: StrategyConfig | None,
        locks: LockBackend | None,
        monitor: ConflictMonitor | None,
    ) -> StrategyTable:
        """The strategies given, then the presets for the names not given.

        A Distributed without a backend is bound to ``locks``.
        """
        table = {
            name: s.bound(locks) if isinstance(s, Distributed) else s
            for name, s in given(strategies).items()
        }
        own = _lease_backend(table.get("distributed"))
        if locks is not None and own is not None and own is not locks:
            raise InvalidInput(
                "locks=... and the Distributed strategy's own locks=... are two different lock "
                "backends; give the backend once (a Distributed() without locks= uses the engine's)"
            )
        table.setdefault("optimistic", Optimistic())
        table.setdefault("pessimistic", Pessimistic())
        if locks is not None:
            table.setdefault("distributed", Distributed(locks=locks))
        chosen = locks if locks is not None else own
        monitor = _add_adaptive(table, monitor)
        return cls(table, chosen, _backends(table, locks), monitor)


def _lease_backend(strategy: Strategy | None) -> LockBackend | None:
    return strategy.locks if isinstance(strategy, Distributed) else None


def _backends(table: Mapping[str, Strategy], locks: LockBackend | None) -> tuple[LockBackend, ...]:
    """``locks`` and the backends of the Distributed strategies in ``table``, each once."""
    found = [locks, *(_lease_backend(s) for s in table.values())]
    unique: list[LockBackend] = []
    for backend in found:
        if backend is not None and all(backend is not u for u in unique):
            unique.append(backend)
    return tuple(unique)


def _add_adaptive(table: dict[str, Strategy], monitor: ConflictMonitor | None) -> ConflictMonitor:
    """Add the "adaptive" preset unless one was given; return its monitor."""
    adaptive = table.get("adaptive")
    if isinstance(adaptive, Adaptive):
        if monitor is not None and monitor is not adaptive.monitor:
            raise InvalidInput(
                "monitor=... and the Adaptive strategy's monitor are two different monitors; "
                "give one (the Adaptive you pass carries its own)"
            )
        monitor = adaptive.monitor
    monitor = monitor if monitor is not None else ConflictMonitor()
    to = monitor.escalate_to
    escalated = table.get(to)
    if escalated is None or to in ("optimistic", "adaptive"):
        raise InvalidInput(
            f"the adaptive strategy escalates to {to!r}, which this engine does not have as a "
            "locking strategy; use 'pessimistic' or configure locks=... for 'distributed'"
        )
    optimistic = table["optimistic"]
    if adaptive is None and isinstance(optimistic, Optimistic):
        table["adaptive"] = Adaptive(optimistic=optimistic, escalated=escalated, monitor=monitor)
    return monitor


def with_bounds(
    strategies: StrategyConfig | None,
    lock_timeout: float | None,
    lease_wait: float | None,
    *,
    has_backend: bool,
) -> StrategyConfig | None:
    """``strategies`` with the presets that ``lock_timeout`` and ``lease_wait`` configure.

    A given strategy that says otherwise is refused: one wait, one bound.
    """
    if lock_timeout is None and lease_wait is None:
        return strategies
    table = dict(given(strategies))
    if lock_timeout is not None:
        preset = table.setdefault("pessimistic", Pessimistic(lock_timeout=lock_timeout))
        if _pessimistic_bound(preset, lock_timeout) != lock_timeout:
            raise InvalidInput(
                f"lock_timeout={lock_timeout:g} and Pessimistic(lock_timeout="
                f"{_pessimistic_bound(preset, lock_timeout):g}) in strategies= are two bounds "
                "for one wait; give one"
            )
    if lease_wait is not None:
        if "distributed" not in table and not has_backend:
            raise InvalidInput(
                "lease_wait bounds the distributed strategy's wait for a lease, and this engine "
                'has no lock backend: give redis_url=... or locks="advisory" too'
            )
        preset = table.setdefault("distributed", Distributed(wait=lease_wait))
        if isinstance(preset, Distributed) and preset.wait != lease_wait:
            raise InvalidInput(
                f"lease_wait={lease_wait:g} and Distributed(wait={preset.wait:g}) in strategies= "
                "are two bounds for one wait; give one"
            )
    return table


def _pessimistic_bound(strategy: object, otherwise: float) -> float:
    """A waiting Pessimistic's lock_timeout; ``otherwise`` for NOWAIT or another kind."""
    if isinstance(strategy, Pessimistic) and not strategy.nowait:
        return strategy.lock_timeout
    return otherwise


def unknown_strategy(name: str, known: Mapping[str, Strategy]) -> str:
    hint = ""
    if name == "distributed":
        hint = (
            "; the distributed strategy needs a lock backend: Engine.connect(..., redis_url=...) "
            'or Engine.connect(..., locks="advisory") on PostgreSQL, or Engine(store, locks=...) '
            "or strategies=[flowlock.Distributed(locks=...)]"
        )
    return f"unknown strategy {name!r}; this engine has {sorted(known)}{hint}"
