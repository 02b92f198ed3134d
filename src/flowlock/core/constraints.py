"""Rules across instances: capacities, uniqueness and rate limits.

A constraint counts instances (or applied transitions) per key. The key is a pure function of
the instance. What a transition does to a constraint travels with its history entry as a
`Claim`; the store applies the claims in the transition's own transaction and refuses the
whole commit when one does not fit. See the constraints guide.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from flowlock.core.errors import DefinitionError, StepFailed, TransitionRefused

if TYPE_CHECKING:
    from flowlock.core.models import Instance

__all__ = [
    "MAX_WAIT",
    "Capacity",
    "CapacityReached",
    "CapacityUsage",
    "Claim",
    "ConstraintRefused",
    "Constraints",
    "Rate",
    "RateLimited",
    "RateRule",
    "Slots",
    "State",
    "Unique",
    "UniqueViolation",
    "checked_claims",
    "constraint_claims",
    "key_of",
]

Key = Callable[["Instance"], object]
"""What a constraint counts by: a pure function of the instance (its data, usually). None
exempts the instance; anything else is turned into text with `str`."""

MAX_WAIT = 300.0
"""The longest `Capacity(wait=)` in seconds: every wait has a bound."""


def _kind(kind: object, owner: str) -> str | None:
    if kind is None:
        return None
    if not isinstance(kind, str) or not kind or len(kind) > 200:
        raise DefinitionError(f"{owner}: kind must be a non-empty text of at most 200 characters")
    return kind


def _limit(limit: object, owner: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise DefinitionError(f"{owner}: limit must be a whole number of at least 1, not {limit!r}")
    return limit


def _key(key: object, owner: str) -> Key:
    if not callable(key):
        raise DefinitionError(f"{owner}: key must be a function of the instance, not {key!r}")
    return key


@dataclass(frozen=True, slots=True, init=False)
class Capacity:
    """At most `limit` instances per key in a state (a slot each while they stay).

    `limit=1` is a mutex per key. `wait`: seconds a `fire` may wait for a slot to free
    before CapacityReached (None: refuse at once), woken when one is released. `kind`: the
    name the slots are counted under (default `<workflow>.<state>`); constraints of one kind
    share their slots, also across workflows.
    """

    key: Key
    limit: int
    wait: float | None
    kind: str | None

    def __init__(
        self,
        key: Key,
        limit: int,
        *,
        wait: float | timedelta | None = None,
        kind: str | None = None,
    ) -> None:
        owner = "Capacity"
        object.__setattr__(self, "key", _key(key, owner))
        object.__setattr__(self, "limit", _limit(limit, owner))
        if isinstance(wait, timedelta):
            wait = wait.total_seconds()
        if wait is not None and (
            isinstance(wait, bool)
            or not isinstance(wait, int | float)
            or not math.isfinite(wait)
            or not 0 < wait <= MAX_WAIT
        ):
            raise DefinitionError(
                f"Capacity: wait must be seconds above 0 and at most {MAX_WAIT:g}, not {wait!r}"
            )
        object.__setattr__(self, "wait", None if wait is None else float(wait))
        object.__setattr__(self, "kind", _kind(kind, owner))


@dataclass(frozen=True, slots=True, init=False)
class Unique:
    """At most one instance per key in `states` (None: in any state but a final one)."""

    key: Key
    states: tuple[str, ...] | None
    kind: str | None

    def __init__(
        self, key: Key, states: Sequence[str] | None = None, *, kind: str | None = None
    ) -> None:
        owner = "Unique"
        object.__setattr__(self, "key", _key(key, owner))
        if isinstance(states, str):
            states = (states,)
        if states is not None and not states:
            raise DefinitionError("Unique: states must name at least one state (or be None)")
        object.__setattr__(self, "states", None if states is None else tuple(states))
        object.__setattr__(self, "kind", _kind(kind, owner))


@dataclass(frozen=True, slots=True, init=False)
class Rate:
    """At most `limit` applied transitions per key in any window of length `per` (a sliding
    window: each application is timed on the database server's clock)."""

    key: Key
    per: timedelta
    limit: int
    kind: str | None

    def __init__(self, key: Key, per: timedelta, limit: int, *, kind: str | None = None) -> None:
        owner = "Rate"
        object.__setattr__(self, "key", _key(key, owner))
        if not isinstance(per, timedelta) or per <= timedelta(0) or per > timedelta(days=366):
            raise DefinitionError(f"Rate: per must be a timedelta above 0, not {per!r}")
        object.__setattr__(self, "per", per)
        object.__setattr__(self, "limit", _limit(limit, owner))
        object.__setattr__(self, "kind", _kind(kind, owner))


class State(str):
    """A state name with a capacity: `State("in_review", capacity=Capacity(...))`. It is the
    text of its name everywhere a state name goes (states=, source=, target=)."""

    capacity: Capacity | None

    def __new__(cls, name: str, *, capacity: Capacity | None = None) -> State:
        if capacity is not None and not isinstance(capacity, Capacity):
            raise DefinitionError(f"state {name!r}: capacity must be a flowlock.Capacity")
        made = super().__new__(cls, name)
        made.capacity = capacity
        return made


@dataclass(frozen=True, slots=True)
class Slots:
    """A capacity or uniqueness rule of a workflow: a slot per instance in `states`."""

    kind: str
    key: Key
    limit: int
    states: frozenset[str]
    unique: bool
    wait: float | None


@dataclass(frozen=True, slots=True)
class RateRule:
    """A rate limit of a workflow's transition."""

    kind: str
    key: Key
    per: float
    limit: int
    transition: str


@dataclass(frozen=True, slots=True)
class Constraints:
    """Every rule of one workflow (empty for most)."""

    slots: tuple[Slots, ...] = ()
    rates: tuple[RateRule, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.slots or self.rates)

    def kind(self, kind: str) -> Slots | RateRule | None:
        """The rule counted under `kind`, if this workflow has one."""
        rules: list[Slots | RateRule] = [*self.slots, *self.rates]
        return next((rule for rule in rules if rule.kind == kind), None)

    def canonical(self) -> list[dict[str, Any]]:
        """The rules as plain JSON for the definition's canonical form (keys by name)."""
        from flowlock.core.versions import callable_name

        form: list[dict[str, Any]] = [
            {
                "kind": s.kind,
                "rule": "unique" if s.unique else "capacity",
                "key": callable_name(s.key),
                "limit": s.limit,
                "states": sorted(s.states),
                "wait": s.wait,
            }
            for s in self.slots
        ]
        form += [
            {
                "kind": r.kind,
                "rule": "rate",
                "key": callable_name(r.key),
                "limit": r.limit,
                "per": r.per,
                "transition": r.transition,
            }
            for r in self.rates
        ]
        return sorted(form, key=lambda f: (f["kind"], f["rule"]))


def gather(
    workflow: str,
    states: Iterable[str],
    targets: Iterable[str],
    finals: Iterable[str],
    unique: Unique | None,
    rates: Mapping[str, Rate],
    problems: list[str],
) -> Constraints:
    """The workflow's rules from its `State(capacity=)` names (in states= or a transition's
    targets), its `unique=` and its transitions' `rate=`; conflicts go to `problems`."""
    capacities: dict[str, Capacity] = {}
    for state in (*states, *targets):
        cap = getattr(state, "capacity", None)
        if cap is None:
            continue
        known = capacities.get(str(state))
        if known is not None and known != cap:
            problems.append(f"state {str(state)!r} is given two different capacities")
        capacities[str(state)] = cap
    slots = [
        Slots(
            cap.kind or f"{workflow}.{state}",
            cap.key,
            cap.limit,
            frozenset({state}),
            False,
            cap.wait,
        )
        for state, cap in capacities.items()
    ]
    if unique is not None:
        if not isinstance(unique, Unique):
            problems.append("unique must be a flowlock.Unique")
        else:
            state_list = [str(s) for s in states]
            chosen = unique.states or [s for s in state_list if s not in set(finals)]
            missing = [s for s in chosen if s not in state_list]
            if missing:
                problems.append(f"Unique names states the workflow lacks: {', '.join(missing)}")
            slots.append(
                Slots(
                    unique.kind or f"{workflow}.unique",
                    unique.key,
                    1,
                    frozenset(chosen),
                    True,
                    None,
                )
            )
    rules = [
        RateRule(
            rate.kind or f"{workflow}.{name}.rate",
            rate.key,
            rate.per.total_seconds(),
            rate.limit,
            name,
        )
        for name, rate in rates.items()
    ]
    kinds = [s.kind for s in slots] + [r.kind for r in rules]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        problems.append(
            f"two constraints of workflow {workflow!r} share the kind {', '.join(twice)}"
        )
    return Constraints(tuple(slots), tuple(rules))


@dataclass(frozen=True, slots=True)
class Claim:
    """What one commit does to one constraint, in its transaction.

    `op`: "take" a slot of `key` (refused when `limit` are held; an instance holding a slot of
    `kind` under another key gives it back first), "release" the slot the instance holds of
    `kind` (if any), or "count" one application against the rate limit of `key` (`per`
    seconds, `limit`). `unique`: a refused take is a UniqueViolation.
    """

    op: Literal["take", "release", "count"]
    kind: str
    key: str = ""
    limit: int = 0
    per: float = 0.0
    unique: bool = False


def key_of(key: Key, inst: Instance, kind: str) -> str | None:
    """The key `inst` counts under, or None (exempt). StepFailed-like errors are the caller's."""
    value = key(inst)
    if value is None:
        return None
    text = str(value)
    if not text or len(text) > 500:
        raise ValueError(f"constraint {kind!r}: a key must be 1 to 500 characters, got {text!r}")
    return text


def constraint_claims(
    rules: Constraints, before: Instance | None, after: Instance, event: str | None
) -> tuple[Claim, ...]:
    """The claims of a move from `before` (None: a create) to `after` by `event`: a slot
    released where the instance leaves a rule's states (or its key changes), one taken where
    it enters them, a rate count for a rate-limited event. Releases come before takes."""
    releases: list[Claim] = []
    takes: list[Claim] = []
    for rule in rules.slots:
        inside = after.state in rule.states
        was = before is not None and before.state in rule.states
        new_key = key_of(rule.key, after, rule.kind) if inside else None
        if was:
            assert before is not None
            old_key = key_of(rule.key, before, rule.kind)
            if old_key == new_key:
                continue
            releases.append(Claim("release", rule.kind))
        if new_key is not None:
            takes.append(Claim("take", rule.kind, new_key, rule.limit, unique=rule.unique))
    counts = [
        Claim("count", r.kind, key, r.limit, r.per)
        for r in rules.rates
        if r.transition == event and (key := key_of(r.key, after, r.kind)) is not None
    ]
    return (*releases, *takes, *counts)


def checked_claims(
    workflow: str, rules: Constraints, before: Instance | None, after: Instance, event: str
) -> tuple[Claim, ...]:
    """`constraint_claims` of `event` (a create's: "create"), a key function's own error
    raised as StepFailed (where it ran: `before`, or the new instance)."""
    try:
        return constraint_claims(rules, before, after, None if before is None else event)
    except Exception as exc:
        at = after if before is None else before
        raise StepFailed(
            workflow=workflow,
            event=event,
            instance_id=after.id,
            step="constraint key",
            state=at.state,
            version=at.version,
            error=exc,
        ) from exc


@dataclass(frozen=True, slots=True)
class CapacityUsage:
    """Who holds the slots of one key (`engine.capacity(kind, key)`), oldest first; for a rate
    limit, the instances whose transitions count in the current window. `limit`: the rule's
    (None when no registered rule or stored row knows it)."""

    kind: str
    key: str
    limit: int | None
    holders: tuple[str, ...]
    rule: Literal["capacity", "unique", "rate"] | None = None
    window: float | None = None

    @property
    def used(self) -> int:
        return len(self.holders)

    @property
    def free(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.used)


class ConstraintRefused(TransitionRefused):
    """A rule across instances refused the transition; nothing was written."""

    def __init__(
        self,
        message: str,
        *,
        instance_id: str,
        kind: str,
        key: str,
        limit: int,
        version: int | None = None,
        event: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.kind = kind
        self.key = key
        self.limit = limit
        self.version = version
        self.event = event
        super().__init__(message)


class CapacityReached(ConstraintRefused):
    """Every slot of the key is held; nothing was written. Retry once a holder leaves the
    state, or give the state's Capacity a wait=."""

    def __init__(
        self,
        *,
        instance_id: str,
        kind: str,
        key: str,
        limit: int,
        holders: Sequence[str],
        version: int | None = None,
        event: str | None = None,
    ) -> None:
        self.holders = tuple(holders)
        shown = ", ".join(self.holders[:10]) + (" ..." if len(self.holders) > 10 else "")
        super().__init__(
            f"instance {instance_id!r} cannot enter {kind!r} for key {key!r}: all {limit} "
            f"slots are held (by {shown or 'nobody'}); nothing was written. Retry once a "
            "holder leaves the state",
            instance_id=instance_id,
            kind=kind,
            key=key,
            limit=limit,
            version=version,
            event=event,
        )


class UniqueViolation(ConstraintRefused):
    """Another instance holds the key in the unique states; nothing was written."""

    def __init__(
        self,
        *,
        instance_id: str,
        kind: str,
        key: str,
        holder: str | None,
        version: int | None = None,
        event: str | None = None,
    ) -> None:
        self.holder = holder
        self.holders = () if holder is None else (holder,)
        super().__init__(
            f"instance {instance_id!r} cannot take key {key!r} of {kind!r}: instance "
            f"{holder!r} holds it; nothing was written. Move or end {holder!r} first",
            instance_id=instance_id,
            kind=kind,
            key=key,
            limit=1,
            version=version,
            event=event,
        )


class RateLimited(ConstraintRefused):
    """The key's rate limit is reached; nothing was written. Retry after `retry_after`
    seconds."""

    def __init__(
        self,
        *,
        instance_id: str,
        kind: str,
        key: str,
        limit: int,
        per: float,
        retry_after: float,
        version: int | None = None,
        event: str | None = None,
    ) -> None:
        self.per = per
        self.retry_after = max(0.0, retry_after)
        super().__init__(
            f"{event or 'the transition'} on instance {instance_id!r}: key {key!r} of "
            f"{kind!r} reached its limit of {limit} per {per:g} s; nothing was written. "
            f"Retry after {self.retry_after:.3f} s",
            instance_id=instance_id,
            kind=kind,
            key=key,
            limit=limit,
            version=version,
            event=event,
        )
