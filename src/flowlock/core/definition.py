"""Workflow definitions: states, transitions, guards and effects. Pure values, no I/O.

A definition is validated when built, so a workflow that registers can run.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from flowlock.core.constraints import Capacity, Constraints, Rate, State, Unique, gather
from flowlock.core.errors import DefinitionError
from flowlock.core.models import Timing
from flowlock.core.outbox import Emit
from flowlock.core.payloads import InvalidPayload, PayloadSchema, payload_schema

if TYPE_CHECKING:
    from flowlock.core.models import Instance

__all__ = [
    "MAX_AFTER",
    "STRATEGIES",
    "SYNC_STEPS",
    "Effect",
    "EmitFn",
    "Guard",
    "Step",
    "StrategyName",
    "Timing",
    "Transition",
    "Workflow",
]

StrategyName: TypeAlias = Literal["optimistic", "pessimistic", "distributed", "adaptive"]
STRATEGIES: tuple[str, ...] = ("optimistic", "pessimistic", "distributed", "adaptive")

POLICIES: Mapping[str, str] = {
    "approval": "optimistic",
    "ticket": "optimistic",
    "inventory": "pessimistic",
    "allocation": "pessimistic",
    "cross-service": "distributed",
    "scheduled-job": "distributed",
    "adaptive": "adaptive",
}
"""The seed article's decision guide as presets: `policy=` on a Workflow or Transition picks
its strategy. Approvals and tickets rarely conflict (optimistic); stock and allocation must
apply every step on hot rows (pessimistic); work coordinated across services needs a lease
(distributed); a scheduled job runs once per tick (distributed here, and
[`flowlock.jobs.RunOnce`][flowlock.jobs.RunOnce] for the job itself); "adaptive" starts optimistic
and escalates hot instances."""


def _resolve(
    strategy: str | None, policy: str | None, owner: str, problems: list[str]
) -> str | None:
    if strategy is not None and strategy not in STRATEGIES:
        problems.append(f"{owner}: unknown strategy {strategy!r}; use one of {STRATEGIES}")
    if policy is None:
        return strategy
    preset = POLICIES.get(policy)
    if preset is None:
        problems.append(f"{owner}: unknown policy {policy!r}; use one of {tuple(POLICIES)}")
        return strategy
    if strategy is not None and strategy != preset:
        problems.append(
            f"{owner}: policy {policy!r} means strategy {preset!r}, but strategy={strategy!r} "
            "was also given; give one of them"
        )
    return preset


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}")


@dataclass(frozen=True, slots=True)
class Step:
    """What an effect may return instead of plain data: new data, optionally a target, and the
    messages to emit.

    The target is one of the transition's declared targets. A countersign, say, stays in
    `pending` until quorum. `emit`: [`Emit`][flowlock.Emit] values, written to the outbox in the
    transition's own commit (nothing when it does not apply).
    """

    data: Mapping[str, Any]
    target: str | None = None
    emit: Sequence[Emit] = ()


Guard: TypeAlias = Callable[["Instance", Any, "str | None"], bool]
"""`guard(instance, payload, actor)`: `payload` is the call's JSON object, or the parsed model
when the transition declares `payload=` (see the payloads guide). True lets the transition
run; False, or raising [`flowlock.GuardRejected`][flowlock.GuardRejected] with a reason,
refuses it. Pure and synchronous: it may run more than once, under a row lock (an `async def`
guard is refused with DefinitionError). Any other exception it raises reaches the caller as
[`flowlock.StepFailed`][flowlock.StepFailed], nothing written."""

Effect: TypeAlias = Callable[["Instance", Any, "str | None"], "Mapping[str, Any] | Step"]
"""`effect(instance, payload, actor)`: returns the instance's new data (or a
[`Step`][flowlock.core.definition.Step]), JSON within the engine's `max_payload_bytes` (else
InvalidInput / PayloadTooLarge). Must be pure, synchronous and must not mutate its arguments: the
optimistic strategy may run it again. An exception it raises (other than GuardRejected or
InvalidInput) becomes StepFailed."""

EmitFn: TypeAlias = Callable[["Instance", Any, "str | None"], "Sequence[Emit]"]
"""`emit(instance, payload, actor)`: the messages a transition emits, a list of
[`Emit`][flowlock.Emit]. `instance` is as the transition leaves it (its new state, data and
version). Pure and synchronous like an effect: it may run again on a retry, and what it returns
is written only if the transition commits."""


SYNC_STEPS = (
    "guards and effects must be synchronous, pure functions of (instance, payload, actor): "
    "flowlock may run them again on a retry and runs them under a row lock, so they must not do "
    "I/O or await anything. Read what they need before fire() and pass it in the payload; do "
    "side effects after fire() returns"
)
"""Why a step may not be `async def` (the message of the DefinitionError that refuses one)."""


def _is_async(fn: object) -> bool:
    """Whether calling `fn` gives an awaitable instead of running it.

    True for an `async def` function or method, a `functools.partial` of one, or an
    object whose `__call__` is one.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        return True
    if inspect.isroutine(fn) or isinstance(fn, type):
        return False
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - the class's, not the instance's
    return call is not None and (
        inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call)
    )


def _check_step(fn: object, step: str, transition: str) -> None:
    if fn is None:
        return
    if not callable(fn):
        raise DefinitionError(f"transition {transition!r}: {step} must be callable")
    if _is_async(fn):
        raise DefinitionError(
            f"transition {transition!r}: the {step} {_label(fn)} is async; {SYNC_STEPS}"
        )


def _label(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return repr(name)


MAX_AFTER = timedelta(days=36_500)
"""The longest `after` or `every` a timed transition takes (about 100 years): every store keeps
such a due time exactly."""


MAX_LIMIT = 10**15
"""The most firings `limit=` takes (every store counts them exactly)."""


def _duration(value: object, what: str, transition: str) -> float | None:
    """`value` (a timedelta, or None) in seconds, checked positive and at most MAX_AFTER."""
    if value is None:
        return None
    if not isinstance(value, timedelta):
        raise DefinitionError(
            f"transition {transition!r}: {what}= takes a datetime.timedelta, not "
            f"{type(value).__name__} ({value!r})"
        )
    if value <= timedelta(0) or value > MAX_AFTER:
        raise DefinitionError(
            f"transition {transition!r}: {what}={value!r} must be positive and at most "
            f"{MAX_AFTER.days} days"
        )
    return value.total_seconds()


def _names(value: str | Sequence[str], what: str, transition: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not items:
        raise DefinitionError(f"transition {transition!r} needs at least one {what}")
    return items


def _given_states(*values: str | Sequence[str]) -> tuple[State, ...]:
    """The `State(capacity=)` names among a transition's sources and targets."""
    found: list[State] = []
    for value in values:
        items = (value,) if isinstance(value, str) else tuple(value)
        found += [s for s in items if isinstance(s, State) and s.capacity is not None]
    return tuple(found)


@dataclass(frozen=True, slots=True, init=False)
class Transition:
    """An event that moves an instance from one of `source` to `target`.

    `target` may list several states. The first is the default; an effect returning
    `Step(target=...)` picks another.

    A timed transition fires by itself. `after`: once the instance has stayed in a `source`
    state this long (its stay begins when it enters the state; transitions that keep the state
    do not reset it). A timed transition whose target is its source is a reminder; `every`
    repeats it while the instance stays (at most `limit` firings in all, when given). Callers
    may still fire it early. See the timers guide.

    `emit`: a pure function of (instance after the transition, payload, actor) returning the
    [`Emit`][flowlock.Emit] messages to write to the outbox in the same commit. See the outbox
    guide.

    `payload`: a Pydantic model class or a JSON Schema dict the call's payload must match.
    It is checked before anything is read (InvalidPayload otherwise); the guard, effect and
    emit receive the parsed model (for a dict: the checked dict). See the payloads guide.

    `rate`: a [`Rate`][flowlock.Rate] limit on how often it applies per key. `capacity`: a
    [`Capacity`][flowlock.Capacity] of its target state(s), the same as naming the target as a
    [`State`][flowlock.State] with that capacity. See the constraints guide.
    """

    name: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    guard: Guard | None
    effect: Effect | None
    strategy: StrategyName | None
    policy: str | None
    after: timedelta | None
    every: timedelta | None
    limit: int | None
    emit: EmitFn | None
    payload: PayloadSchema | None
    rate: Rate | None
    capacities: tuple[State, ...]

    def __init__(
        self,
        name: str,
        *,
        source: str | Sequence[str],
        target: str | Sequence[str],
        guard: Guard | None = None,
        effect: Effect | None = None,
        strategy: StrategyName | None = None,
        policy: str | None = None,
        after: timedelta | None = None,
        every: timedelta | None = None,
        limit: int | None = None,
        emit: EmitFn | None = None,
        payload: type[Any] | Mapping[str, Any] | None = None,
        rate: Rate | None = None,
        capacity: Capacity | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise DefinitionError(
                f"transition name {name!r} must start with a letter and use only letters, digits, "
                "'_', '.', '-' (at most 100 characters)"
            )
        problems: list[str] = []
        resolved = _resolve(strategy, policy, f"transition {name!r}", problems)
        if problems:
            raise DefinitionError(problems=problems)
        _check_step(guard, "guard", name)
        _check_step(effect, "effect", name)
        _check_step(emit, "emit", name)
        object.__setattr__(self, "name", name)
        if rate is not None and not isinstance(rate, Rate):
            raise DefinitionError(f"transition {name!r}: rate must be a flowlock.Rate")
        object.__setattr__(self, "rate", rate)
        given = _given_states(source, target)
        if capacity is not None:
            # The same as State(target, capacity=...) for each of its targets.
            targets = _names(target, "target", name)
            given += tuple(State(str(t), capacity=capacity) for t in targets)
        object.__setattr__(self, "capacities", given)
        object.__setattr__(self, "sources", tuple(map(str, _names(source, "source", name))))
        object.__setattr__(self, "targets", tuple(map(str, _names(target, "target", name))))
        object.__setattr__(self, "guard", guard)
        object.__setattr__(self, "effect", effect)
        object.__setattr__(self, "strategy", resolved)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "emit", emit)
        _check_timing(self, after, every, limit)
        object.__setattr__(self, "payload", _timed_payload(self, payload))

    @property
    def target(self) -> str:
        """The default target state."""
        return self.targets[0]

    @property
    def timed(self) -> bool:
        """Whether the transition fires by itself (`after=` or `every=` given)."""
        return self.after is not None

    def timing(self) -> Timing | None:
        """What a stay in one of the sources arms for this transition, or None if untimed."""
        if self.after is None:
            return None
        every = None if self.every is None else self.every.total_seconds()
        return Timing(self.name, self.after.total_seconds(), every, self.limit)


def _timed_payload(t: Transition, declared: object) -> PayloadSchema | None:
    """The transition's payload schema; a timed one must accept `{}`, what a timer sends."""
    schema = payload_schema(declared, f"transition {t.name!r}")
    if schema is not None and t.after is not None:
        try:
            schema.parse({}, workflow="", event=t.name)
        except InvalidPayload as exc:
            raise DefinitionError(
                f"transition {t.name!r} is timed, and a timer fires it with the payload {{}}, "
                f"which its payload schema refuses ({'; '.join(exc.paths) or 'the object'}); "
                "give every field a default"
            ) from None
    return schema


def _check_timing(t: Transition, after: object, every: object, limit: object) -> None:
    """Set `after`, `every` and `limit` on `t`, checked (DefinitionError says what is wrong)."""
    name = t.name
    _duration(after, "after", name)
    _duration(every, "every", name)
    if every is not None and after is None:
        after = every  # a bare every= first fires one period into the stay
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise DefinitionError(
                f"transition {name!r}: limit={limit!r} must be a whole number of firings from "
                f"1 to {MAX_LIMIT:,}"
            )
        if every is None:
            raise DefinitionError(
                f"transition {name!r}: limit= counts the firings of every=; give every= too "
                "(a timed transition without every= fires once per stay)"
            )
    if every is not None and not set(t.sources) & set(t.targets):
        raise DefinitionError(
            f"transition {name!r}: every= repeats a reminder while the instance stays, but its "
            f"targets {t.targets} never keep it in a source {t.sources}; drop every= or make "
            "the transition's target one of its sources"
        )
    object.__setattr__(t, "after", after)
    object.__setattr__(t, "every", every)
    object.__setattr__(t, "limit", limit)


@dataclass(frozen=True, slots=True, init=False, eq=False)
class Workflow:
    """A named state machine.

    Validated at construction; raises [`DefinitionError`][flowlock.core.definition.DefinitionError]
    listing every problem found.

    `data`: a Pydantic model class or a JSON Schema dict a new instance's data must match
    (checked by `create`, InvalidPayload otherwise; the data is stored as sent).

    `unique`: a [`Unique`][flowlock.Unique] rule, at most one instance per key in its states.
    States named as [`State`][flowlock.State] may carry a capacity. See the constraints guide.
    """

    name: str
    states: tuple[str, ...]
    initial: str
    transitions: Mapping[str, Transition]
    strategy: StrategyName | None
    policy: str | None
    data: PayloadSchema | None
    constraints: Constraints = field(repr=False, compare=False)
    _allowed: Mapping[str, tuple[str, ...]] = field(repr=False, compare=False)
    _timed: Mapping[str, tuple[Timing, ...]] = field(repr=False, compare=False)

    def __init__(
        self,
        name: str,
        *,
        states: Iterable[str],
        initial: str,
        transitions: Iterable[Transition],
        strategy: StrategyName | None = None,
        policy: str | None = None,
        data: type[Any] | Mapping[str, Any] | None = None,
        unique: Unique | None = None,
    ) -> None:
        problems: list[str] = []
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            problems.append(
                f"workflow name {name!r} must start with a letter and use only letters, digits, "
                "'_', '.', '-' (at most 100 characters)"
            )
        state_list = list(states)
        state_set = set(map(str, state_list))
        problems += _state_problems(state_list, initial)
        resolved = _resolve(strategy, policy, f"workflow {name!r}", problems)
        by_name = _index_transitions(transitions, state_set, problems)
        if initial in state_set and not problems:
            unreachable = _unreachable(initial, state_list, by_name.values())
            if unreachable:
                problems.append(f"states unreachable from {initial!r}: {', '.join(unreachable)}")
        allowed = {s: tuple(t.name for t in by_name.values() if s in t.sources) for s in state_list}
        constraints = gather(
            name,
            state_list,
            [s for t in by_name.values() for s in t.capacities],
            [s for s in state_list if not allowed.get(s)],
            unique,
            {t.name: t.rate for t in by_name.values() if t.rate is not None},
            problems,
        )
        if problems:
            raise DefinitionError(problems=problems)

        object.__setattr__(self, "name", name)
        object.__setattr__(self, "states", tuple(map(str, state_list)))
        object.__setattr__(self, "constraints", constraints)
        object.__setattr__(self, "initial", str(initial))
        object.__setattr__(self, "transitions", dict(by_name))
        object.__setattr__(self, "strategy", resolved)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "data", payload_schema(data, f"workflow {name!r}: data"))
        object.__setattr__(self, "_allowed", allowed)
        timed = {
            s: tuple(
                timing
                for t in by_name.values()
                if s in t.sources and (timing := t.timing()) is not None
            )
            for s in state_list
        }
        object.__setattr__(self, "_timed", {s: ts for s, ts in timed.items() if ts})

    def allowed(self, state: str) -> tuple[str, ...]:
        """The events that may fire from `state`."""
        return self._allowed.get(state, ())

    def safety_warnings(self, default_strategy: str) -> list[str]:
        """Why this workflow may be unsafe under load with `default_strategy`.

        Some transitions must apply every call: they keep the state and change data, like a
        stock count. Left to plain optimistic retries, they run out under contention.
        """
        warnings = []
        for t in self.transitions.values():
            strategy = t.strategy or self.strategy or default_strategy
            must_apply = t.effect is not None and set(t.sources) & set(t.targets)
            if must_apply and strategy == "optimistic":
                warnings.append(
                    f"workflow {self.name!r}: {t.name!r} changes data without leaving its state "
                    "(every call must apply), but runs optimistic: under contention callers run "
                    "out of retries. Set policy='inventory' (pessimistic) or policy='adaptive'"
                )
        return warnings

    def timers(self, state: str) -> tuple[Timing, ...]:
        """What a stay in `state` arms: one Timing per timed transition leaving from it."""
        return self._timed.get(state, ())

    @property
    def has_timers(self) -> bool:
        """Whether any transition of the workflow is timed."""
        return bool(self._timed)

    def is_final(self, state: str) -> bool:
        """A state no event leaves."""
        return not self._allowed.get(state)

    def to_mermaid(self) -> str:
        """The workflow as a Mermaid `stateDiagram-v2`.

        One edge per (source, target) of each transition, labelled with its event, plus
        `[*] --> initial` and `final --> [*]`. Guarded edges read `event [guarded]`. Names
        Mermaid would misread are declared with an alias and drawn under their own name.
        `flowlock diagram module:attr` prints it.
        """
        ids = _mermaid_ids(self.states)
        lines = ["stateDiagram-v2"]
        lines += [f'    state "{s}" as {ids[s]}' for s in self.states if ids[s] != s]
        lines.append(f"    [*] --> {ids[self.initial]}")
        for t in self.transitions.values():
            label = f"{t.name} [guarded]" if t.guard is not None else t.name
            if t.after is not None:
                label += f" after {_human(t.after)}"
                if t.every is not None:
                    label += f" every {_human(t.every)}"
            for source in t.sources:
                lines += [f"    {ids[source]} --> {ids[target]}: {label}" for target in t.targets]
        lines += [f"    {ids[s]} --> [*]" for s in self.states if self.is_final(s)]
        return "\n".join(lines) + "\n"


def _human(span: timedelta) -> str:
    """A duration as a diagram label: "48h", "90s", "1.5d"."""
    seconds = span.total_seconds()
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


_MERMAID_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# Words Mermaid's state-diagram grammar reads as syntax, not as a state's id.
_MERMAID_WORDS = frozenset(
    {"as", "class", "classdef", "click", "direction", "end", "hide", "left", "note", "of",
     "right", "state", "style"}
)  # fmt: skip


def _mermaid_ids(states: Iterable[str]) -> dict[str, str]:
    """A Mermaid id for each state: its own name if Mermaid reads it, else a fresh `s<n>`."""
    names = list(states)
    taken = set(names)
    ids: dict[str, str] = {}
    for n, state in enumerate(names):
        if _MERMAID_ID.fullmatch(state) and state.lower() not in _MERMAID_WORDS:
            ids[state] = state
            continue
        alias = f"s{n}"
        while alias in taken:
            alias += "_"
        taken.add(alias)
        ids[state] = alias
    return ids


def _state_problems(state_list: list[str], initial: str) -> list[str]:
    """What is wrong with a workflow's states and its initial state, in the order reported."""
    problems: list[str] = []
    state_set = set(state_list)
    for s in state_list:
        if not isinstance(s, str) or not _NAME.fullmatch(s):
            problems.append(f"state name {s!r} is not a valid name")
    if len(state_set) != len(state_list):
        dups = sorted({s for s in state_list if state_list.count(s) > 1})
        problems.append(f"duplicate states: {', '.join(dups)}")
    if not state_list:
        problems.append("a workflow needs at least one state")
    if not initial:
        problems.append("no initial state given")
    elif initial not in state_set:
        problems.append(f"initial state {initial!r} is not one of the states")
    return problems


def _index_transitions(
    transitions: Iterable[Transition], state_set: set[str], problems: list[str]
) -> dict[str, Transition]:
    """The transitions by name.

    Non-transitions, duplicate names and unknown states are added to `problems`.
    """
    by_name: dict[str, Transition] = {}
    for t in transitions:
        if not isinstance(t, Transition):
            problems.append(f"{t!r} is not a Transition")
            continue
        if t.name in by_name:
            problems.append(f"duplicate transition name {t.name!r}")
        by_name[t.name] = t
        for s in (*t.sources, *t.targets):
            if s not in state_set:
                problems.append(f"transition {t.name!r} names unknown state {s!r}")
    return by_name


def _unreachable(
    initial: str, state_list: list[str], transitions: Iterable[Transition]
) -> list[str]:
    """The states no sequence of transitions reaches from `initial`, in declaration order."""
    edges = list(transitions)
    reached = {initial}
    frontier = [initial]
    while frontier:
        here = frontier.pop()
        for t in edges:
            if here in t.sources:
                fresh = [nxt for nxt in t.targets if nxt not in reached]
                reached.update(fresh)
                frontier.extend(fresh)
    return [s for s in state_list if s not in reached]
