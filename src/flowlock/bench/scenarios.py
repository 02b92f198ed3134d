"""The benchmark's scenarios: what the callers of one round fire, and what "correct" means.

A scenario is a small object with three jobs, kept free of timing and rendering:

- ``workflows(workers)``: the definitions to register (built from :mod:`flowlock.examples`);
- ``setup(engine, key, workers)``: create the fresh instance(s) of one round and return the calls
  its callers make, all released at once by the runner;
- ``judge(round)``: after the round, given every caller's result and each instance's final state
  and history, say whether the round double-advanced and list any scenario-specific violation the
  generic :func:`flowlock.checker.check` cannot see (it knows nothing about quorums or storms).

Scenarios register themselves in :data:`SCENARIOS` by name; later ones (inventory, hot, spread,
cluster) only have to implement :class:`Scenario` and call :func:`register_scenario`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from flowlock import examples
from flowlock.checker import INVARIANT, Invariant, Violation
from flowlock.definition import Workflow
from flowlock.engine import Engine
from flowlock.models import HistoryEntry, Instance

__all__ = [
    "SCENARIOS",
    "CallResult",
    "CallSpec",
    "Countersign",
    "Judgement",
    "Kind",
    "RoundPlan",
    "RoundRecord",
    "Scenario",
    "Storm",
    "register_scenario",
]

Kind = Literal["applied", "idempotent", "refused", "failed"]
"""How one call ended: it applied the transition, was answered idempotently, was refused by the
workflow (a business rule: TransitionRefused), or failed (lost to concurrency, store error...)."""


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One ``engine.fire`` a caller makes when the round is released."""

    instance_id: str
    event: str
    actor: str | None = None
    payload: Mapping[str, Any] | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The instances a round created (with the state they were created in) and its calls."""

    instances: Mapping[str, str]
    """instance id -> initial state"""
    calls: tuple[CallSpec, ...]


@dataclass(frozen=True, slots=True)
class CallResult:
    """What one call came to. ``latency`` is seconds from the round's release to completion."""

    call: CallSpec
    kind: Kind
    latency: float
    attempts: int
    error: str | None = None
    """The exception's class name for refused and failed calls."""
    message: str | None = None


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A finished round: its plan, every call's result, and what the store holds afterwards."""

    plan: RoundPlan
    results: tuple[CallResult, ...]
    finals: Mapping[str, Instance]
    histories: Mapping[str, Sequence[HistoryEntry]]

    def applied_by_instance(self) -> Counter[str]:
        """How many calls answered applied=True, per instance id."""
        return Counter(r.call.instance_id for r in self.results if r.kind == "applied")


@dataclass(frozen=True, slots=True)
class Judgement:
    """A scenario's verdict on one round, beyond the generic history check."""

    double_advanced: bool
    violations: tuple[Violation, ...] = field(default=())


class Scenario(Protocol):
    """What the runner needs from a scenario."""

    @property
    def name(self) -> str: ...

    @property
    def summary(self) -> str:
        """One line for ``--help`` and the report."""
        ...

    @property
    def default_rounds(self) -> int: ...

    def workflows(self, workers: int) -> Sequence[Workflow]:
        """The workflow definitions the scenario's instances use."""
        ...

    def invariant(self, workers: int) -> Invariant | None:
        """A data invariant the checker runs after every history row, if any."""
        ...

    async def setup(self, engine: Engine, key: str, workers: int) -> RoundPlan:
        """Create this round's fresh instance(s); ids start with ``key``, unique per round."""
        ...

    def judge(self, record: RoundRecord, workers: int) -> Judgement:
        """Scenario-specific correctness of one finished round."""
        ...


@dataclass(frozen=True, slots=True)
class Storm:
    """The seed's two-admins incident, scaled up: N callers fire ``approve`` at one pending
    instance at once. Correct when exactly one call applies and the rest are idempotent."""

    name: str = "storm"
    summary: str = "N callers fire approve at one pending instance at once"
    default_rounds: int = 10

    def workflows(self, workers: int) -> Sequence[Workflow]:
        return [examples.approval()]

    def invariant(self, workers: int) -> Invariant | None:
        return None

    async def setup(self, engine: Engine, key: str, workers: int) -> RoundPlan:
        inst = await engine.create("approval", instance_id=key, data={"amount": 120})
        calls = tuple(CallSpec(inst.id, "approve", actor=f"admin-{i}") for i in range(workers))
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, workers: int) -> Judgement:
        found: list[Violation] = []
        double = False
        applied = record.applied_by_instance()
        for iid in record.plan.instances:
            rows = len(record.histories.get(iid, ()))
            # 为什么 both counts: the seed's bug showed up as several callers told "applied"
            # (and several history rows); either alone is a double advance.
            if applied[iid] > 1 or rows > 1:
                double = True
                found.append(
                    Violation(
                        INVARIANT,
                        f"instance {iid!r}: storm double-advanced ({applied[iid]} calls applied, "
                        f"{rows} history rows; exactly one of each expected)",
                    )
                )
            idempotent = sum(
                1 for r in record.results if r.call.instance_id == iid and r.kind == "idempotent"
            )
            final = record.finals.get(iid)
            if idempotent and final is not None and final.state != "approved":
                # An idempotent answer claims the approval happened; the store must agree.
                found.append(
                    Violation(
                        INVARIANT,
                        f"instance {iid!r}: {idempotent} call(s) answered idempotent but the "
                        f"instance is still {final.state!r}",
                    )
                )
        return Judgement(double, tuple(found))


@dataclass(frozen=True, slots=True)
class Countersign:
    """One document needs N distinct signatures (quorum N); N callers each sign once, at once.
    Correct when every applied signature is in history exactly once and the state moves to
    approved exactly once, at quorum (and not before)."""

    name: str = "countersign"
    summary: str = "one instance with quorum N; N callers each sign once at once"
    default_rounds: int = 3

    def workflows(self, workers: int) -> Sequence[Workflow]:
        return [examples.countersign(quorum=workers)]

    def invariant(self, workers: int) -> Invariant | None:
        def signers_unique(data: Mapping[str, Any]) -> str | None:
            signers = list(data.get("signers", []))
            twice = sorted(s for s, n in Counter(signers).items() if n > 1)
            return f"signed more than once: {', '.join(twice)}" if twice else None

        return signers_unique

    async def setup(self, engine: Engine, key: str, workers: int) -> RoundPlan:
        inst = await engine.create("countersign", instance_id=key, data={"signers": []})
        calls = tuple(CallSpec(inst.id, "sign", actor=f"signer-{i}") for i in range(workers))
        return RoundPlan({inst.id: inst.state}, calls)

    def judge(self, record: RoundRecord, workers: int) -> Judgement:
        found: list[Violation] = []
        double = False
        for iid in record.plan.instances:
            history = record.histories.get(iid, ())
            signed = Counter(e.actor for e in history)
            applied = Counter(
                r.call.actor
                for r in record.results
                if r.call.instance_id == iid and r.kind == "applied"
            )
            if signed != applied:
                extra = sorted(str(a) for a in (signed - applied))
                lost = sorted(str(a) for a in (applied - signed))
                found.append(
                    Violation(
                        INVARIANT,
                        f"instance {iid!r}: history signatures differ from applied calls "
                        f"(in history only: {extra or 'none'}; applied only: {lost or 'none'})",
                    )
                )
            advances = [
                e for e in history if e.to_state == "approved" and e.from_state != "approved"
            ]
            if len(advances) > 1:
                double = True
                found.append(
                    Violation(
                        INVARIANT,
                        f"instance {iid!r}: moved to 'approved' {len(advances)} times",
                    )
                )
            for e in history:
                n = len(e.data.get("signers", []))
                if (e.to_state == "approved") != (n >= workers):
                    found.append(
                        Violation(
                            INVARIANT,
                            f"instance {iid!r}: state {e.to_state!r} with {n} of {workers} "
                            "signatures",
                            e.version,
                        )
                    )
        return Judgement(double, tuple(found))


SCENARIOS: dict[str, Scenario] = {}
"""Every known scenario by name, in the order ``flowlock bench`` runs them by default."""


def register_scenario(scenario: Scenario) -> Scenario:
    """Add ``scenario`` to :data:`SCENARIOS` (replacing one of the same name)."""
    SCENARIOS[scenario.name] = scenario
    return scenario


register_scenario(Storm())
register_scenario(Countersign())
