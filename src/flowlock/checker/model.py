"""One instance as the search models it, and each recorded call as a move on it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from flowlock.checker.calls import CallRecord
from flowlock.core.definition import Transition, Workflow

INF = float("inf")
"""The completion time of a call that may take effect at any later time."""

# A model is (exists, state, version, data key); None in a place means "unknown": any value is
# possible there until an observation pins it. Data is compared through small integer keys (the
# same JSON gets the same key), which keeps models cheap to hash in the memo.
Model: TypeAlias = tuple[bool | None, str | None, int | None, int | None]
UNKNOWN_START: Model = (None, None, None, None)
ABSENT: Model = (False, None, None, None)

CREATE, FIRE, GET, CREATE_MAYBE, FIRE_MAYBE = range(5)


@dataclass(slots=True)
class SearchOp:
    """One call as the search sees it (fails, idempotent fires and unknown gets are left out:
    they have no effect to place)."""

    index: int
    kind: int
    invoked_at: float
    completed_at: float  # inf for a call that may take effect at any later time
    version: int | None = None
    state: str | None = None
    data: int | None = None
    after: Model = UNKNOWN_START
    # With the workflow: the event's sources, its only target (None for several) and whether
    # it keeps the data (no effect). Without: sources is None.
    sources: frozenset[str] | None = None
    target: str | None = None
    keeps_data: bool = False
    initial: str | None = None
    group: int = -1  # unknown calls: their interchangeable group, and rank in it
    rank: int = 0


def step(m: Model, o: SearchOp) -> Model | None:
    """The model after ``o`` takes effect on ``m``, or None when it cannot."""
    exists, state, version, data = m
    kind = o.kind
    if kind == GET:
        if exists is False:
            return None
        if version is not None and version != o.version:
            return None
        if state is not None and state != o.state:
            return None
        if data is not None and data != o.data:
            return None
        return o.after
    if kind == FIRE:
        if exists is False or (version is not None and o.version != version + 1):
            return None
        if o.sources is not None:
            if state is not None and state not in o.sources:
                return None
            if o.keeps_data and data is not None and data != o.data:
                return None
        return o.after
    if kind == FIRE_MAYBE:
        return _maybe_fire(m, o)
    # A create (ok or maybe): only where the instance may not exist yet.
    if exists:
        return None
    return o.after


def _maybe_fire(m: Model, o: SearchOp) -> Model | None:
    """An unknown fire taking effect: one version more; the state and data its event gives
    when the workflow says (else unknown until observed)."""
    exists, state, version, data = m
    if exists is False:
        return None
    nxt = None if version is None else version + 1
    if o.sources is None:
        return (True, None, nxt, None)
    if state is not None and state not in o.sources:
        return None
    return (True, o.target, nxt, data if o.keeps_data else None)


def why_not(m: Model, o: SearchOp, names: Names) -> str:
    """Why ``o`` cannot take effect on ``m``, in words (for a violation's message)."""
    exists, state, version, data = m
    if o.kind in (CREATE, CREATE_MAYBE):
        return "the instance already exists"
    if exists is False:
        return "the instance does not exist yet"
    if version is not None and o.version is not None:
        want = version if o.kind == GET else version + 1
        if o.version != want:
            return f"it reports version {o.version} where version {want} was due"
    if o.sources is not None and state is not None and state not in o.sources:
        return f"its event is not allowed from state {state!r}"
    if state is not None and o.kind == GET and o.state != state:
        return f"it reads state {o.state!r} where the instance is in {state!r}"
    if data is not None and o.data != data:
        if o.kind == FIRE:
            return (
                f"its event has no effect, so it keeps data {names.data(data)}, but it returned "
                f"data {names.data(o.data)}"
            )
        return f"it reads data {names.data(o.data)} where the data is {names.data(data)}"
    return "the instance as it is then does not allow it"


class Names:
    """Keys for data (the same JSON, the same key) and the way back, for messages."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._by_repr: dict[str, int] = {}
        self._data: list[Mapping[str, Any]] = []

    def key(self, data: Mapping[str, Any]) -> int:
        # Why repr first: it is a few times cheaper than canonical JSON, and the calls that see
        # one version mostly get its data in the same key order. Canonical JSON decides.
        shown = repr(data)
        found = self._by_repr.get(shown)
        if found is not None:
            return found
        try:
            text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            text = repr(sorted(data.items(), key=lambda kv: str(kv[0])))
        found = self._keys.get(text)
        if found is None:
            found = self._keys[text] = len(self._data)
            self._data.append(data)
        self._by_repr[shown] = found
        return found

    def data(self, key: int | None) -> str:
        return "unknown" if key is None else json.dumps(self._data[key], sort_keys=True)

    def model(self, m: Model) -> str:
        exists, state, version, data = m
        if exists is False:
            return "not created yet"
        v = "an unknown version" if version is None else f"version {version}"
        s = "an unknown state" if state is None else f"state {state!r}"
        return f"{v}, {s}, data {self.data(data)}"


def search_ops(
    records: Sequence[CallRecord], indexes: Sequence[int], wf: Workflow | None, names: Names
) -> list[SearchOp]:
    """The calls that take (or may take) effect, in invoke order, ready for the search."""
    ops: list[SearchOp] = []
    groups: dict[tuple[int, str | None], int] = {}
    ranks: list[int] = []
    for i in sorted(indexes, key=lambda i: records[i].invoked_at):
        r = records[i]
        o = _search_op(i, r, wf, names)
        if o is None:
            continue
        if o.completed_at == INF:
            key = (o.kind, r.event if wf is not None else None)
            o.group = groups.setdefault(key, len(groups))
            if o.group == len(ranks):
                ranks.append(0)
            o.rank = ranks[o.group]
            ranks[o.group] += 1
        ops.append(o)
    return ops


def _search_op(i: int, r: CallRecord, wf: Workflow | None, names: Names) -> SearchOp | None:
    """``r`` as the search sees it, or None when it has no effect to place."""
    if r.outcome == "fail" or r.idempotent or (r.op == "get" and r.outcome == "unknown"):
        return None
    t = wf.transitions.get(r.event or "") if wf is not None and r.op == "fire" else None
    if r.outcome == "unknown":
        if r.op == "create":
            initial = None if wf is None else wf.initial
            return SearchOp(i, CREATE_MAYBE, r.invoked_at, INF, after=(True, initial, 1, None))
        if wf is not None and t is None:
            return None  # an event the workflow does not have never applies
        o = SearchOp(i, FIRE_MAYBE, r.invoked_at, INF)
        _bind(o, t)
        return o
    # Both checked by the record.
    assert r.completed_at is not None
    assert r.data is not None
    kind = {"create": CREATE, "fire": FIRE, "get": GET}[r.op]
    key = names.key(r.data)
    o = SearchOp(i, kind, r.invoked_at, r.completed_at, r.version, r.state, key)
    o.after = (True, r.state, r.version, key)
    _bind(o, t)
    return o


def _bind(o: SearchOp, t: Transition | None) -> None:
    if t is None:
        return
    o.sources = frozenset(t.sources)
    o.target = t.targets[0] if len(t.targets) == 1 else None
    o.keeps_data = t.effect is None
