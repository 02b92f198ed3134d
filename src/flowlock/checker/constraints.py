"""The constraint rules of the check: no key ever held more slots than its limit, no slot
leaked, no rate window over its limit, each proved from the store's own trail.

Pure, no I/O. A store appends a slot event for every take and release (numbered per key from
1, with the holder count after it) and a rate event for every counted application, in the
commit of the transition (or create) that made them; `flowlock.stores.constraint_store` says
more. The rows are read as the store gives them (`ConstraintStore.constraint_rows()`): this
module names the fields it reads, nothing else, so it does not depend on the stores.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from flowlock.checker.verdicts import (
    LEAKED_SLOT,
    MISSING_SLOT,
    ORPHAN_CONSTRAINT_EVENT,
    OVER_CAPACITY,
    OVER_RATE,
    SLOT_COUNTER,
    SLOT_LOG,
    Violation,
)
from flowlock.core.constraint_rows import ConstraintRows, RateEvent, SlotEvent, SlotRow
from flowlock.core.constraints import Key, key_of
from flowlock.core.definition import Workflow
from flowlock.core.models import HistoryEntry, Instance

__all__ = [
    "SlotRule",
    "Trail",
    "check_constraints",
    "check_trails",
    "rules_of",
    "slot_rules",
]

# A difference of times below this is taken as none: epoch seconds as a float carry about a
# microsecond, so two events the store timed one window apart may read a hair less apart.
_CLOCK_GRAIN = 1e-6
# The same flaw on one key is reported once, with how many more times it occurs.
_SHOWN = 1


@dataclass(frozen=True, slots=True)
class SlotRule:
    """A capacity or uniqueness rule as the check knows it: its kind, the states that hold a
    slot and, from a registered workflow, its key (None: read from a stored definition)."""

    kind: str
    states: frozenset[str]
    key: Key | None = None


Rules: TypeAlias = Callable[[Instance], Sequence[SlotRule] | None]
"""The slot rules an instance runs under (None: not known, so not checked)."""


@dataclass(frozen=True, slots=True)
class Trail:
    """One instance as the check reads it: as it is now, and its state after each of its
    versions (version 1: the state it was created in)."""

    instance: Instance
    states: Mapping[int, str]

    @classmethod
    def of(cls, instance: Instance, history: Iterable[HistoryEntry]) -> Trail:
        """The trail of `instance` from its history rows (another instance's are left out)."""
        rows = sorted((e for e in history if e.instance_id == instance.id), key=_version)
        states = {1: rows[0].from_state if rows else instance.state}
        states.update((e.version, e.to_state) for e in rows)
        return cls(instance, states)


def _version(entry: HistoryEntry) -> int:
    return entry.version


def slot_rules(workflow: Workflow | Mapping[str, Any]) -> list[SlotRule]:
    """The slot rules of a registered workflow (with their keys), or of a stored definition's
    canonical form (`DefinitionVersion.definition`, without)."""
    if isinstance(workflow, Workflow):
        return [SlotRule(s.kind, s.states, s.key) for s in workflow.constraints.slots]
    return [
        SlotRule(str(c["kind"]), frozenset(str(s) for s in c.get("states", ())))
        for c in workflow.get("constraints", ())
        if c.get("rule") in ("capacity", "unique")
    ]


def rules_of(
    forms: Mapping[str, Mapping[int, Mapping[str, Any]]],
    registered: Callable[[str, int | None], Workflow | None] = lambda _n, _v: None,
) -> Rules:
    """The rules each instance runs under: its registered workflow's at its version (keys
    included, so a missing slot shows), else its stored version's canonical form, else every
    stored version's states together (a version unknown here)."""

    def rules(instance: Instance) -> Sequence[SlotRule] | None:
        wf = registered(instance.workflow, instance.definition_version)
        if wf is not None:
            return slot_rules(wf)
        versions = forms.get(instance.workflow)
        if not versions:
            return None
        form = versions.get(instance.definition_version or 0)
        if form is not None:
            return slot_rules(form)
        merged: dict[str, set[str]] = defaultdict(set)
        for each in versions.values():
            for rule in slot_rules(each):
                merged[rule.kind] |= rule.states
        return [SlotRule(kind, frozenset(states)) for kind, states in merged.items()]

    return rules


def check_constraints(
    rows: ConstraintRows,
    instances: Iterable[Instance],
    history: Iterable[HistoryEntry],
    rules: Rules | Mapping[str, Sequence[SlotRule]] | None = None,
    *,
    current: bool = True,
) -> list[Violation]:
    """Every constraint rule on a store's `rows`, its `instances` and their `history` (every
    row of each), read after the rows. `rules`: the slot rules of each workflow by name (or a
    function of the instance); a workflow left out is not held to any. See `check_trails`."""
    by_id: dict[str, list[HistoryEntry]] = defaultdict(list)
    for entry in history:
        by_id[entry.instance_id].append(entry)
    trails = {i.id: Trail.of(i, by_id.get(i.id, ())) for i in instances}
    if isinstance(rules, Mapping):
        table = rules
        return check_trails(rows, trails, lambda inst: table.get(inst.workflow), current=current)
    return check_trails(rows, trails, rules, current=current)


def check_trails(
    rows: ConstraintRows,
    trails: Mapping[str, Trail],
    rules: Rules | None = None,
    *,
    current: bool = True,
) -> list[Violation]:
    """Every constraint rule, the instances given as trails by id.

    Always: each key's events add up (SLOT_LOG), no take above its limit (OVER_CAPACITY), the
    counters and slot rows are what the events replay to (SLOT_COUNTER), no instance holds two
    slots of a kind (LEAKED_SLOT), every event of an instance given names one of its commits
    (ORPHAN_CONSTRAINT_EVENT; an instance not given may have been purged, its events are not
    judged) and no rate window holds more than its limit (OVER_RATE).

    With `current` (the rows and instances are of one moment: nothing moved between the
    reads), each slot's instance exists and, where its rules are known, is in a state of the
    slot's kind (LEAKED_SLOT); with a rule's key, each instance in its states holds a slot of
    its key (MISSING_SLOT)."""
    found: list[Violation] = []
    holders = _replay(rows.log, found)
    found.extend(_counters(rows, holders))
    found.extend(_twice(rows.slots))
    found.extend(_orphans(rows, trails))
    found.extend(_takes_in_state(rows.log, trails, rules))
    found.extend(_rates(rows.rates))
    if current:
        found.extend(_leaks(rows.slots, trails, rules))
        if rules is not None:
            found.extend(_missing(rows.slots, trails, rules))
    return found


def _what(kind: str, key: str) -> str:
    return f"key {key!r} of {kind!r}"


def _more(count: int) -> str:
    return f" (and {count - _SHOWN} more like it)" if count > _SHOWN else ""


@dataclass
class _Replay:
    """A key's holders (instance -> the version of its take) after its last event."""

    holders: dict[str, int]
    seq: int


def _replay(log: Sequence[SlotEvent], found: list[Violation]) -> dict[tuple[str, str], _Replay]:
    """Each key's events in sequence order, added up; every flaw on the way goes to `found`."""
    keys: dict[tuple[str, str], list[SlotEvent]] = defaultdict(list)
    for event in log:
        keys[(event.kind, event.key)].append(event)
    replayed: dict[tuple[str, str], _Replay] = {}
    for (kind, key), events in keys.items():
        events.sort(key=lambda e: e.seq)
        replayed[(kind, key)] = _one_key(kind, key, events, found)
    return replayed


def _one_key(kind: str, key: str, events: list[SlotEvent], found: list[Violation]) -> _Replay:
    held: dict[str, int] = {}
    # Three lists of (message, version): the numbering, the moves and the counts; the takes
    # over the limit. The first of each is reported, with how many more.
    gaps: list[tuple[str, int]] = []
    moves: list[tuple[str, int]] = []
    counts: list[tuple[str, int]] = []
    over: list[tuple[str, int]] = []
    expected = 1
    for e in events:
        who = f"instance {e.instance_id!r}"
        if e.seq != expected:
            gaps.append((f"its events are not numbered 1, 2, 3...: {e.seq} where {expected} "
                         "was due", e.version))  # fmt: skip
        expected = e.seq + 1
        if e.delta == 1:
            if e.instance_id in held:
                moves.append((f"{who} took a slot it held already", e.version))
            held[e.instance_id] = e.version
        elif e.delta == -1:
            if held.pop(e.instance_id, None) is None:
                moves.append((f"{who} released a slot it did not hold", e.version))
        else:
            moves.append((f"event {e.seq} moves the count by {e.delta}, not 1 or -1", e.version))
        if e.holders != len(held):
            counts.append((f"event {e.seq} says {e.holders} holder(s), its events add up to "
                           f"{len(held)}", e.version))  # fmt: skip
        count = max(e.holders, len(held))
        if e.delta == 1 and count > e.limit:
            over.append((f"{who}'s take (event {e.seq}) left {count} holders, over the limit "
                         f"of {e.limit}", e.version))  # fmt: skip
    what = _what(kind, key)
    for rule, flaws in ((SLOT_LOG, gaps), (SLOT_LOG, moves), (SLOT_LOG, counts),
                        (OVER_CAPACITY, over)):  # fmt: skip
        if flaws:
            message, version = flaws[0]
            found.append(Violation(rule, f"{what}: {message}{_more(len(flaws))}", version))
    return _Replay(held, events[-1].seq if events else 0)


def _counters(rows: ConstraintRows, replayed: Mapping[tuple[str, str], _Replay]) -> list[Violation]:
    """Each key's counter holds its replayed count and last sequence number, and its slot rows
    are its replayed holders, each since the version of its take."""
    found: list[Violation] = []
    rows_of: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for slot in rows.slots:
        rows_of[(slot.kind, slot.key)][slot.instance_id] = slot.version
    counters = {(c.kind, c.key): c for c in rows.counters}
    # A store may serialize a rate limit's counts on the key's counter row too: no slot
    # ever, whatever its sequence number says.
    rated = {(r.kind, r.key) for r in rows.rates} - set(replayed) - set(rows_of)
    for place in sorted({*counters, *replayed, *rows_of}):
        what = _what(*place)
        replay = replayed.get(place, _Replay({}, 0))
        counter = counters.get(place)
        if place in rated and counter is not None and counter.holders == 0:
            continue
        if counter is None:
            if replay.seq:
                message = f"{what}: {replay.seq} event(s) but no counter row"
                found.append(Violation(SLOT_COUNTER, message))
        elif (counter.holders, counter.seq) != (len(replay.holders), replay.seq):
            found.append(
                Violation(
                    SLOT_COUNTER,
                    f"{what}: its counter says {counter.holders} holder(s) after event "
                    f"{counter.seq}; its events add up to {len(replay.holders)} after event "
                    f"{replay.seq}",
                )
            )
        held = rows_of.get(place, {})
        if held != replay.holders:
            found.append(Violation(SLOT_COUNTER, f"{what}: {_diff(held, replay.holders)}"))
    return found


def _diff(held: Mapping[str, int], replayed: Mapping[str, int]) -> str:
    extra = sorted(set(held) - set(replayed))
    gone = sorted(set(replayed) - set(held))
    moved = sorted(i for i in set(held) & set(replayed) if held[i] != replayed[i])
    parts = []
    if extra:
        parts.append(f"slot rows of {', '.join(map(repr, extra))} that no take left held")
    if gone:
        parts.append(f"no slot row of {', '.join(map(repr, gone))}, whom the events leave holding")
    if moved:
        parts.append(
            "slot rows of another version than their take: "
            + ", ".join(f"{i!r} at {held[i]}, taken at {replayed[i]}" for i in moved)
        )
    return "; ".join(parts)


def _twice(slots: Sequence[SlotRow]) -> list[Violation]:
    """An instance holds at most one slot of a kind."""
    keys: dict[tuple[str, str], list[str]] = defaultdict(list)
    for slot in slots:
        keys[(slot.kind, slot.instance_id)].append(slot.key)
    return [
        Violation(
            LEAKED_SLOT,
            f"instance {instance_id!r} holds {len(held)} slots of {kind!r} (keys "
            f"{', '.join(map(repr, sorted(held)))}): a take of another key must release the "
            "old one in the same commit",
        )
        for (kind, instance_id), held in sorted(keys.items())
        if len(held) > 1
    ]


def _orphans(rows: ConstraintRows, trails: Mapping[str, Trail]) -> list[Violation]:
    """Every slot or rate event of an instance given names one of its commits: a history row,
    or its create (version 1; a rate is counted by a transition, never by a create)."""
    found: list[Violation] = []
    events: list[tuple[str, str, str, int, str]] = [
        (e.kind, e.key, e.instance_id, e.version, "take" if e.delta == 1 else "release")
        for e in rows.log
    ]
    events += [(r.kind, r.key, r.instance_id, r.version, "rate count") for r in rows.rates]
    for kind, key, instance_id, version, what in events:
        trail = trails.get(instance_id)
        if trail is None:
            continue
        if version in trail.states and not (what == "rate count" and version == 1):
            continue
        found.append(
            Violation(
                ORPHAN_CONSTRAINT_EVENT,
                f"a {what} of {_what(kind, key)} names version {version} of instance "
                f"{instance_id!r}, which has no {'transition' if version > 1 else 'create'} "
                f"there (it is at version {trail.instance.version}): it was written without "
                "the commit it belongs to",
                version,
            )
        )
    return found


def _takes_in_state(
    log: Sequence[SlotEvent], trails: Mapping[str, Trail], rules: Rules | None
) -> list[Violation]:
    """A slot is taken by a commit that leaves its instance in a state of the slot's rule."""
    if rules is None:
        return []
    found: list[Violation] = []
    for e in log:
        trail = trails.get(e.instance_id)
        state = None if trail is None or e.delta != 1 else trail.states.get(e.version)
        known = None if trail is None else rules(trail.instance)
        if state is None or known is None:
            continue
        if not any(r.kind == e.kind and state in r.states for r in known):
            found.append(
                Violation(
                    LEAKED_SLOT,
                    f"instance {e.instance_id!r} took a slot of {_what(e.kind, e.key)} at "
                    f"version {e.version}, which left it in {state!r}: no rule of that kind "
                    "holds a slot there",
                    e.version,
                )
            )
    return found


def _leaks(
    slots: Sequence[SlotRow], trails: Mapping[str, Trail], rules: Rules | None
) -> list[Violation]:
    """A slot is held by an instance that exists and, where its rules are known, is in a state
    of a rule of the slot's kind: the commit that left the state releases it."""
    found: list[Violation] = []
    for slot in slots:
        trail = trails.get(slot.instance_id)
        what = f"instance {slot.instance_id!r} holds a slot of {_what(slot.kind, slot.key)}"
        if trail is None:
            found.append(
                Violation(
                    LEAKED_SLOT,
                    f"{what}, but no such instance exists: whatever removed it kept its slot",
                    slot.version,
                )
            )
            continue
        inst = trail.instance
        known = None if rules is None else rules(inst)
        if known is None or any(r.kind == slot.kind and inst.state in r.states for r in known):
            continue
        found.append(
            Violation(
                LEAKED_SLOT,
                f"{what} (taken at version {slot.version}), but it is in {inst.state!r} at "
                f"version {inst.version}, no state of a rule of that kind: the commit that "
                "left the rule's states should have released it",
                inst.version,
            )
        )
    return found


def _missing(
    slots: Sequence[SlotRow], trails: Mapping[str, Trail], rules: Rules
) -> list[Violation]:
    """An instance in a state of a rule whose key is known, with a key (not None), holds a
    slot of that key."""
    found: list[Violation] = []
    held = {(s.kind, s.instance_id): s.key for s in slots}
    for trail in trails.values():
        inst = trail.instance
        for rule in rules(inst) or ():
            if rule.key is None or inst.state not in rule.states:
                continue
            try:
                key = key_of(rule.key, inst, rule.kind)
            except Exception:  # a key that fails now proves nothing either way
                continue
            has = held.get((rule.kind, inst.id))
            if key is None or has == key:
                continue
            holds = "no slot" if has is None else f"a slot of key {has!r}"
            found.append(
                Violation(
                    MISSING_SLOT,
                    f"instance {inst.id!r} is in {inst.state!r} at version {inst.version} "
                    f"with {_what(rule.kind, key)}, but holds {holds} of that kind: the commit "
                    "that brought it there should have taken one",
                    inst.version,
                )
            )
    return found


def _rates(rates: Sequence[RateEvent]) -> list[Violation]:
    """In no window of `per` seconds ending at an application were more than `limit` of a
    key's applications timed (each against the limit and window it was counted under)."""
    keys: dict[tuple[str, str], list[RateEvent]] = defaultdict(list)
    for event in rates:
        keys[(event.kind, event.key)].append(event)
    found: list[Violation] = []
    for (kind, key), events in sorted(keys.items()):
        events.sort(key=lambda e: e.at)
        times = [e.at for e in events]
        over: list[tuple[RateEvent, int]] = []
        for i, e in enumerate(events):
            # Those timed less than `per` before it, up to itself.
            first = bisect.bisect_right(times, e.at - e.per + _CLOCK_GRAIN, 0, i)
            count = i - first + 1
            if count > e.limit:
                over.append((e, count))
        if over:
            e, count = over[0]
            found.append(
                Violation(
                    OVER_RATE,
                    f"{_what(kind, key)}: instance {e.instance_id!r}'s application at version "
                    f"{e.version} was the {count}th within {e.per:g} s, over the limit of "
                    f"{e.limit}{_more(len(over))}",
                    e.version,
                )
            )
    return found
