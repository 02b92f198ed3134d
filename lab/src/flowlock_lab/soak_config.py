"""What a soak runs (`SoakConfig`, validated without I/O) and its limits."""

from __future__ import annotations

from dataclasses import dataclass

from flowlock.bench.registry import ALIASES, DEFAULT_STRATEGIES, STRATEGIES, expand
from flowlock.core.errors import InvalidInput
from flowlock_lab.soak_results import MAX_SOAK_SECONDS

__all__ = [
    "MAX_SOAK_CALLERS",
    "MAX_SOAK_FAULTS",
    "MAX_SOAK_PROCESSES",
    "SOAK_CALLERS_PER_PROCESS",
    "SOAK_PROCESSES",
    "SoakConfig",
]

SOAK_PROCESSES = 3
"""Worker processes of a soak when `processes` is not given: three, so a killed or paused one
leaves two at work, on a 2-core machine that also runs both servers."""
SOAK_CALLERS_PER_PROCESS = 4
"""Caller tasks per worker process of a soak when `callers` is not given."""
MAX_SOAK_PROCESSES = 8
MAX_SOAK_CALLERS = 64
"""A soak's ceilings: each caller holds at most one database connection, each process opens a
store pool and an advisory pool of about `callers / processes` each, and the soak's own
PostgreSQL allows 100 connections."""
MAX_SOAK_FAULTS = 2000
"""The most faults one soak injects, whatever its length and interval."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakConfig:
    """A soak: mixed load with every flowlock strategy (or `strategies`) for `seconds`.

    `seconds` is at most `MAX_SOAK_SECONDS`.
    `processes` worker processes run `callers` tasks in all (default 4 per process).
    The soak runs on an embedded PostgreSQL and Redis of its own.
    With `faults`, a fault comes every `fault_interval` seconds, jittered.
    `max_faults` defaults to as many as fit, capped at `MAX_SOAK_FAULTS`.
    `database_url` and `redis_url` are refused: the soak restarts and inspects its servers.
    The engines batch concurrent calls on one instance unless `batching` is False.
    """

    seconds: int
    faults: bool = False
    processes: int | None = None
    callers: int | None = None
    strategies: tuple[str, ...] | None = None
    seed: int | None = None
    fault_interval: float = 3.0
    max_faults: int | None = None
    database_url: str | None = None
    redis_url: str | None = None
    batching: bool = True

    def validate(self) -> None:
        """Raise InvalidInput for anything that cannot run; does no I/O."""
        if not isinstance(self.batching, bool):
            raise InvalidInput(f"batching must be True or False, not {self.batching!r}")
        if not 1 <= self.seconds <= MAX_SOAK_SECONDS:
            raise InvalidInput(f"--soak takes 1 to {MAX_SOAK_SECONDS} seconds, not {self.seconds}")
        if self.database_url is not None or self.redis_url is not None:
            given = "--database-url" if self.database_url is not None else "--redis-url"
            raise InvalidInput(
                f"the soak runs on servers of its own only (it restarts and inspects them), so "
                f"it refuses {given}; drop it (or unset FLOWLOCK_DATABASE_URL / "
                "FLOWLOCK_REDIS_URL, or add --embedded)"
            )
        if not 1 <= self.process_count() <= MAX_SOAK_PROCESSES:
            raise InvalidInput(
                f"a soak runs 1 to {MAX_SOAK_PROCESSES} processes, not {self.process_count()}"
            )
        if not self.process_count() <= self.caller_count() <= MAX_SOAK_CALLERS:
            raise InvalidInput(
                f"a soak runs {self.process_count()} to {MAX_SOAK_CALLERS} callers (at least "
                f"one per process), not {self.caller_count()}"
            )
        if not 0.5 <= self.fault_interval <= MAX_SOAK_SECONDS:
            raise InvalidInput(
                f"the fault interval must be 0.5 to {MAX_SOAK_SECONDS} s, "
                f"not {self.fault_interval!r}"
            )
        if self.max_faults is not None and not 0 <= self.max_faults <= MAX_SOAK_FAULTS:
            raise InvalidInput(f"max_faults must be 0 to {MAX_SOAK_FAULTS}, not {self.max_faults}")
        for name in self.strategy_names():
            if name not in STRATEGIES:
                known = [*STRATEGIES, *ALIASES]
                raise InvalidInput(f"unknown strategy {name!r}; choose from {', '.join(known)}")
            if STRATEGIES[name].floor:
                raise InvalidInput(
                    f"{name!r} is the benchmark's floor, not a flowlock strategy: the soak "
                    "checks flowlock's answers, so it runs flowlock strategies only"
                )
        if not self.strategy_names():
            raise InvalidInput("choose at least one strategy")

    def process_count(self) -> int:
        return self.processes if self.processes is not None else SOAK_PROCESSES

    def caller_count(self) -> int:
        if self.callers is not None:
            return self.callers
        return self.process_count() * SOAK_CALLERS_PER_PROCESS

    def strategy_names(self) -> tuple[str, ...]:
        if self.strategies:
            return expand(self.strategies)
        return tuple(n for n in DEFAULT_STRATEGIES if not STRATEGIES[n].floor)

    def fault_cap(self) -> int:
        if self.max_faults is not None:
            return self.max_faults
        return min(MAX_SOAK_FAULTS, int(2 * self.seconds / self.fault_interval) + 1)
