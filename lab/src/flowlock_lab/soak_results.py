"""What the soak measures and concludes, as plain values and the pure rules between them.

Nothing here does I/O. The soak hands over what it recorded, and the report renders it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from flowlock.checker import DOUBLE_APPLY, LOST_UPDATE, Invariant, Verdict, Violation, check
from flowlock.core.errors import (
    ConcurrencyError,
    FlowlockError,
    InstanceExists,
    InstanceNotFound,
    LockError,
    LockLost,
    OutcomeUnknown,
    StoreError,
    TransitionRefused,
)
from flowlock.core.models import HistoryEntry, Instance

__all__ = [
    "FAULT_KINDS",
    "MAX_SOAK_SECONDS",
    "OUTCOME_KINDS",
    "Expected",
    "Fault",
    "FaultKind",
    "Leaks",
    "OutcomeKind",
    "RowRule",
    "SoakReport",
    "Status",
    "classify",
    "count_outcomes",
    "judge_store",
    "lost_leases",
]

MAX_SOAK_SECONDS = 3600
"""The longest soak `--soak` accepts (an hour): every part of it is bounded by this."""

Status = Literal["ok", "fail", "unknown"]
"""What the linearizability checker is told about a call: it took effect (`ok`), it surely
did not (`fail`: a typed refusal before any write), or it may have (`unknown`)."""

OutcomeKind = Literal[
    "applied",
    "idempotent",
    "created",
    "read",
    "refused",
    "conflict",
    "lock",
    "store",
    "unknown",
    "killed",
    "other",
    "hung",
    "escaped",
]
"""How one call ended, finer than its `Status`:

- `applied` / `idempotent`: a fire answered with an outcome (ok);
- `created` / `read`: a create or a get answered (ok);
- `refused`: the workflow refused (`TransitionRefused`), or the instance did (not) exist (fail);
- `conflict`: lost to other writers (`ConflictRetriesExhausted`, fail);
- `lock`: a lock or lease could not be taken or was lost (`LockError`, fail);
- `store`: the database failed before any write (`StoreError`, `ConnectionLost`, fail);
- `unknown`: `OutcomeUnknown`, the write may have committed (unknown);
- `killed`: in flight in a worker process the soak killed (unknown);
- `other`: any other flowlock error (unknown);
- `hung`: still unanswered at the soak's own bound on a call (unknown; fails the verdict);
- `escaped`: an exception that is not a `FlowlockError` (unknown; fails the verdict).
"""

OUTCOME_KINDS: tuple[OutcomeKind, ...] = get_args(OutcomeKind)

FaultKind = Literal[
    "kill-worker", "pause-worker", "terminate-backend", "restart-postgres", "restart-redis"
]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
"""What the fault injector does: SIGKILL a worker process (a replacement is started), SIGSTOP one
for a while and SIGCONT it, `pg_terminate_backend` on some of the workers' sessions, restart
PostgreSQL (data kept, same URL), restart Redis empty (same URL)."""


def classify(exc: BaseException) -> tuple[OutcomeKind, Status]:
    """The kind and checker status of a call that raised `exc`."""
    if not isinstance(exc, FlowlockError):
        return "escaped", "unknown"
    if isinstance(exc, OutcomeUnknown):
        return "unknown", "unknown"
    if isinstance(exc, TransitionRefused | InstanceExists | InstanceNotFound):
        return "refused", "fail"
    if isinstance(exc, LockError):
        return "lock", "fail"
    if isinstance(exc, ConcurrencyError):
        return "conflict", "fail"
    if isinstance(exc, StoreError):
        # Every StoreError but OutcomeUnknown says the transaction was rolled back.
        return "store", "fail"
    return "other", "unknown"


def lost_leases(errors: Mapping[str, int]) -> int:
    """Calls that lost their lease before committing (`LockLost`), from the errors by class."""
    return errors.get(LockLost.__name__, 0)


# -- the store afterwards ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Expected:
    """What the calls said about one instance.

    It holds the state it was created in and how many fires answered applied.
    It also counts those that may have applied (unknown).
    `at_most_one`: at most one transition may ever apply, as for an approval.
    """

    initial_state: str
    applied: int = 0
    unknown: int = 0
    at_most_one: bool = False


RowRule = Callable[[HistoryEntry], "str | None"]
"""A workflow's own rule for each of its history rows: a violation's message, or None."""


def judge_store(
    finals: Mapping[str, Instance],
    histories: Mapping[str, Sequence[HistoryEntry]],
    expected: Mapping[str, Expected],
    invariants: Mapping[str, Invariant] | None = None,
    rules: Mapping[str, RowRule] | None = None,
) -> Verdict:
    """The exactly-once verdict on what the store holds.

    It runs [`flowlock.checker.check`][flowlock.checker.check] on every instance.
    Its history rows number at least the calls answered applied.
    At most, they also count the calls whose outcome is unknown.
    Each row must pass its workflow's rule from `rules`; a counter equals its steps.
    An instance expected but missing is a lost update.
    """
    found: list[Violation] = []
    for iid, exp in sorted(expected.items()):
        final = finals.get(iid)
        if final is None:
            if exp.applied:
                found.append(
                    Violation(LOST_UPDATE, f"instance {iid!r}: {exp.applied} fire(s) applied, gone")
                )
            continue
        history = histories.get(iid, ())
        invariant = (invariants or {}).get(final.workflow)
        found.extend(
            check(
                final,
                history,
                initial_state=exp.initial_state,
                expected_applied=exp.applied if exp.unknown == 0 else None,
                invariant=invariant,
            ).violations
        )
        rows = len(history)
        if exp.unknown and rows < exp.applied:
            found.append(
                Violation(
                    LOST_UPDATE,
                    f"instance {iid!r}: {exp.applied} fire(s) answered applied, {rows} in history",
                )
            )
        if exp.unknown and rows > exp.applied + exp.unknown:
            found.append(
                Violation(
                    DOUBLE_APPLY,
                    f"instance {iid!r}: {rows} rows in history, more than the {exp.applied} "
                    f"applied and {exp.unknown} unknown fire(s)",
                )
            )
        rule = (rules or {}).get(final.workflow)
        if rule is not None:
            for entry in history:
                problem = rule(entry)
                if problem is not None:
                    found.append(
                        Violation(LOST_UPDATE, f"instance {iid!r}: {problem}", entry.version)
                    )
        if exp.at_most_one and rows > 1:
            found.append(
                Violation(DOUBLE_APPLY, f"instance {iid!r}: decided {rows} times, at most once")
            )
    return Verdict.of(found)


# -- the report ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault injected: its kind, when, what it hit, and whether it worked.

    `at` counts seconds since the load started.
    A restart that failed or a worker already gone is `False`.
    """

    kind: FaultKind
    at: float
    target: str
    ok: bool = True
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "at_s": round(self.at, 3),
            "target": self.target,
            "ok": self.ok,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class Leaks:
    """What was left after the workers ended and the bounded waits for it to go.

    That is Redis lock keys without a live holder, advisory locks still held,
    and the run's database sessions still open.
    """

    redis_lock_keys: int = 0
    advisory_locks: int = 0
    connections: int = 0

    @property
    def total(self) -> int:
        return self.redis_lock_keys + self.advisory_locks + self.connections

    def to_dict(self) -> dict[str, int]:
        return {
            "redis_lock_keys": self.redis_lock_keys,
            "advisory_locks": self.advisory_locks,
            "connections": self.connections,
        }


_FAILS_THE_VERDICT: tuple[OutcomeKind, ...] = ("escaped", "hung")


@dataclass(frozen=True, slots=True)
class SoakReport:
    """A whole soak: environment and arguments, outcomes, faults, leaks and verdicts.

    `linearizability`: the checker's verdict over every call of every worker, merged.
    `exactly_once`: `judge_store` over what the store holds afterwards.
    `ok` when both are clean, no call escaped or hung, no worker crashed and nothing leaked.
    """

    flowlock_version: str
    postgres_version: str
    redis_version: str | None
    cores: int
    args: Mapping[str, Any]
    duration_s: float
    """Seconds of load (from the workers' start to the stop)."""
    calls: int
    outcomes: Mapping[str, int]
    errors: Mapping[str, int]
    """Calls that raised, by exception class."""
    faults: tuple[Fault, ...]
    leaks: Leaks
    linearizable: bool
    linearizability: Mapping[str, Any]
    exactly_once: Verdict
    workers_started: int = 0
    peak_connections: int = 0
    """The most database sessions the workers held at once (sampled twice a second)."""
    crashes: tuple[str, ...] = ()
    """Worker processes that ended on their own (not killed by a fault), with their last words."""
    error_samples: Mapping[str, str] = field(default_factory=dict)
    """The first message of each exception class in `errors`."""
    escapes: tuple[str, ...] = ()
    """The first exceptions that were not a FlowlockError, as `worker: Type: message`."""
    instances: int = 0
    notes: tuple[str, ...] = ()
    log: tuple[str, ...] = ()

    @property
    def faults_by_kind(self) -> dict[str, int]:
        """Faults that did what they meant to, by kind."""
        counted = Counter(f.kind for f in self.faults if f.ok)
        return {kind: counted[kind] for kind in FAULT_KINDS if counted[kind]}

    @property
    def faults_failed(self) -> int:
        """Faults that could not be done (no worker ready to kill, say)."""
        return sum(1 for f in self.faults if not f.ok)

    @property
    def leases_lost(self) -> int:
        return lost_leases(self.errors)

    @property
    def escaped(self) -> int:
        return sum(self.outcomes.get(kind, 0) for kind in _FAILS_THE_VERDICT)

    @property
    def ok(self) -> bool:
        return (
            self.linearizable
            and self.exactly_once.ok
            and self.escaped == 0
            and not self.crashes
            and self.leaks.total == 0
        )

    def problems(self) -> list[str]:
        """One line per reason the soak is not ok (empty when it is)."""
        lines: list[str] = []
        if not self.linearizable:
            lines.append("linearizability: " + str(self.linearizability.get("describe", "FAILED")))
        if not self.exactly_once.ok:
            lines.append(f"exactly-once: {self.exactly_once.describe()}")
        for kind in _FAILS_THE_VERDICT:
            if self.outcomes.get(kind):
                lines.append(f"{self.outcomes[kind]} call(s) {kind}")
        lines.extend(f"escaped: {e}" for e in self.escapes[:5])
        lines.extend(f"worker crashed: {c}" for c in self.crashes)
        if self.leaks.total:
            lines.append(f"leaked: {self.leaks.to_dict()}")
        return lines


def count_outcomes(kinds: Iterable[OutcomeKind]) -> dict[str, int]:
    """Outcomes counted by kind, in `OUTCOME_KINDS` order, kinds that never happened left
    out."""
    counted = Counter(kinds)
    return {kind: counted[kind] for kind in OUTCOME_KINDS if counted[kind]}
