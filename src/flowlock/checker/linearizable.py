"""``check_linearizable``: is what the callers saw explained by one order of their calls?"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

from flowlock.checker.calls import CallRecord
from flowlock.checker.model import (
    ABSENT,
    CREATE,
    FIRE,
    GET,
    INF,
    UNKNOWN_START,
    Model,
    Names,
    SearchOp,
    search_ops,
    why_not,
)
from flowlock.checker.search import Search
from flowlock.checker.verdicts import (
    DOUBLE_APPLY,
    INVALID_RESULT,
    LOST_UPDATE,
    NOT_LINEARIZABLE,
    STALE_READ,
    UNDECIDED,
    LinearizabilityVerdict,
    LinearizabilityViolation,
)
from flowlock.core.definition import Workflow
from flowlock.core.errors import InvalidInput
from flowlock.core.models import Instance

_STEPS_PER_CALL = 500
_MIN_STEPS = 100_000
_CREATED_VERSION = 1


def check_linearizable(
    calls: Iterable[CallRecord],
    workflow: Workflow | Iterable[Workflow] | None = None,
    *,
    initial: Mapping[str, Instance | None] | None = None,
    max_steps: int | None = None,
) -> LinearizabilityVerdict:
    """Whether the recorded ``calls`` are linearizable, instance by instance.

    ``workflow``: one definition, or several picked by the name the calls returned.
    It says where an event leads; without it, fires are judged on what they returned.
    ``initial``: instance id to the instance before the first call (None: not created).
    By default an instance starts unknown.
    ``max_steps``: the search budget per instance (default 500 a call, at least 100,000).
    An instance that needs more is reported ``undecided``.
    Every violation names its calls by their index in ``calls``.
    """
    records = list(calls)
    for r in records:
        if not isinstance(r, CallRecord):
            raise InvalidInput(f"check_linearizable() takes CallRecords, not {type(r).__name__}")
    if max_steps is not None and (
        not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1
    ):
        raise InvalidInput(f"max_steps must be a positive integer or None, not {max_steps!r}")
    workflows = _workflows(workflow)
    by_instance: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_instance.setdefault(r.instance_id, []).append(i)
    starts = dict(initial or {})
    found: list[LinearizabilityViolation] = []
    for iid, indexes in by_instance.items():
        wf = _workflow_for(workflows, [records[i] for i in indexes])
        found.extend(_check_instance(iid, records, indexes, wf, starts, max_steps))
    return LinearizabilityVerdict(
        ok=not found, instances=len(by_instance), calls=len(records), violations=found
    )


def _workflows(workflow: Workflow | Iterable[Workflow] | None) -> dict[str | None, Workflow]:
    """Workflows by name; a single one is also under None (it applies to every instance)."""
    if workflow is None:
        return {}
    if isinstance(workflow, Workflow):
        return {None: workflow, workflow.name: workflow}
    found: dict[str | None, Workflow] = {}
    for wf in workflow:
        if not isinstance(wf, Workflow):
            raise InvalidInput(f"workflow must be a flowlock Workflow, not {type(wf).__name__}")
        found[wf.name] = wf
    return found


def _workflow_for(
    workflows: Mapping[str | None, Workflow], records: Sequence[CallRecord]
) -> Workflow | None:
    if None in workflows:
        return workflows[None]
    for r in records:
        if r.workflow is not None and r.workflow in workflows:
            return workflows[r.workflow]
    return None


def _start(starts: Mapping[str, Instance | None], iid: str, names: Names) -> Model:
    """The model before the instance's first call: unknown unless ``initial`` says."""
    if iid not in starts:
        return UNKNOWN_START
    inst = starts[iid]
    if inst is None:
        return ABSENT
    if not isinstance(inst, Instance):
        raise InvalidInput(f"initial[{iid!r}] must be an Instance or None")
    return (True, inst.state, inst.version, names.key(inst.data))


def _check_instance(
    iid: str,
    records: Sequence[CallRecord],
    indexes: Sequence[int],
    wf: Workflow | None,
    starts: Mapping[str, Instance | None],
    max_steps: int | None,
) -> list[LinearizabilityViolation]:
    names = Names()
    ops = search_ops(records, indexes, wf, names)
    direct = _direct_violations(iid, records, ops, wf)
    if direct:
        return direct
    first = _start(starts, iid, names)
    budget = max_steps if max_steps is not None else max(_MIN_STEPS, _STEPS_PER_CALL * len(ops))
    search = Search(ops, first, budget)
    result = search.run()
    if result is True:
        return []
    if result is None:
        definite = sum(1 for o in ops if o.completed_at != INF)
        return [
            LinearizabilityViolation(
                iid,
                UNDECIDED,
                f"gave up after {budget} search steps over {definite} completed and "
                f"{len(ops) - definite} unknown call(s): the history is neither proven "
                "linearizable nor proven wrong. Raise max_steps, or record fewer overlapping "
                "or unknown calls per instance",
            )
        ]
    return [_explain(iid, records, ops, search, names)]


def _direct_violations(
    iid: str, records: Sequence[CallRecord], ops: Sequence[SearchOp], wf: Workflow | None
) -> list[LinearizabilityViolation]:
    """Contradictions that hold whatever the order (cheap, and clearer than the search's)."""
    seen = [o for o in ops if o.completed_at != INF]
    found = _invalid_results(iid, records, seen, wf)
    found += _double_applies(iid, records, seen)
    found += _conflicting_versions(iid, records, seen)
    found += _stale(iid, records, seen)
    return found


def _invalid_results(
    iid: str, records: Sequence[CallRecord], seen: Sequence[SearchOp], wf: Workflow | None
) -> list[LinearizabilityViolation]:
    found = []
    for o in seen:
        r = records[o.index]
        problem = _impossible(r, wf)
        if problem is not None:
            found.append(
                LinearizabilityViolation(
                    iid, INVALID_RESULT, f"{_call_name(o.index, r)}: {problem}", (o.index,)
                )
            )
    return found


def _impossible(r: CallRecord, wf: Workflow | None) -> str | None:
    """Why ``r``'s result cannot be right whatever came before it, or None."""
    assert r.version is not None
    if r.op == "create":
        if r.version != _CREATED_VERSION:
            return f"a create answers version {_CREATED_VERSION}, not {r.version}"
        if wf is not None and r.state != wf.initial:
            return f"a create answers the initial state {wf.initial!r}, not {r.state!r}"
        return None
    if wf is not None and r.state not in wf.states:
        return f"state {r.state!r} is not a state of workflow {wf.name!r}"
    if r.op != "fire":
        return None
    if r.version <= _CREATED_VERSION:
        return f"an applied fire answers version {_CREATED_VERSION + 1} or more, not {r.version}"
    if wf is None:
        return None
    t = wf.transitions.get(r.event or "")
    if t is None:
        return f"workflow {wf.name!r} has no event {r.event!r}"
    if r.state not in t.targets:
        return f"event {r.event!r} leads to {', '.join(map(repr, t.targets))}, not {r.state!r}"
    return None


def _double_applies(
    iid: str, records: Sequence[CallRecord], seen: Sequence[SearchOp]
) -> list[LinearizabilityViolation]:
    found = []
    creates = [o.index for o in seen if o.kind == CREATE]
    if len(creates) > 1:
        found.append(_violation(iid, DOUBLE_APPLY, records, creates, "created more than once"))
    by_version: dict[int | None, list[int]] = {}
    for o in seen:
        if o.kind == FIRE:
            by_version.setdefault(o.version, []).append(o.index)
    for version, indexes in by_version.items():
        if len(indexes) > 1:
            found.append(
                _violation(
                    iid,
                    DOUBLE_APPLY,
                    records,
                    indexes,
                    f"{len(indexes)} fires all applied from version {(version or 0) - 1} "
                    f"to version {version}",
                )
            )
    return found


def _conflicting_versions(
    iid: str, records: Sequence[CallRecord], seen: Sequence[SearchOp]
) -> list[LinearizabilityViolation]:
    found = []
    by_version: dict[int | None, list[SearchOp]] = {}
    for o in seen:
        by_version.setdefault(o.version, []).append(o)
    for version, group in sorted(by_version.items(), key=lambda kv: kv[0] or 0):
        if sum(1 for o in group if o.kind == FIRE) > 1:
            continue  # two fires at one version: already a double apply
        contents = {(o.state, o.data) for o in group}
        if len(contents) > 1:
            found.append(
                _violation(
                    iid,
                    LOST_UPDATE,
                    records,
                    [o.index for o in group],
                    f"version {version} was seen with {len(contents)} different contents (state "
                    "and data); one write at that version replaced another",
                )
            )
    return found


def _stale(
    iid: str, records: Sequence[CallRecord], seen: Sequence[SearchOp]
) -> list[LinearizabilityViolation]:
    """A call that began after another completed must see at least that one's version (a
    fire, a newer one; a create, no instance at all)."""
    done = sorted(seen, key=lambda o: o.completed_at)
    ends = [o.completed_at for o in done]
    newest: list[SearchOp] = []
    for o in done:
        newer = not newest or (o.version or 0) > (newest[-1].version or 0)
        newest.append(o if newer else newest[-1])
    found = []
    for o in seen:
        before = bisect.bisect_left(ends, o.invoked_at)
        if before == 0:
            continue
        prior = newest[before - 1]
        v, pv = o.version or 0, prior.version or 0
        if o.kind == CREATE:
            problem = "created although an earlier call had already seen the instance"
            kind = DOUBLE_APPLY
        elif o.kind == GET and v < pv:
            problem = f"read version {v} after version {pv} had been seen"
            kind = STALE_READ
        elif o.kind == FIRE and v <= pv:
            problem = f"applied to reach version {v} after version {pv} had been seen"
            kind = STALE_READ
        else:
            continue
        found.append(
            _violation(
                iid,
                kind,
                records,
                [prior.index, o.index],
                f"{problem}: the second call began after the first completed",
            )
        )
    return found


def _violation(
    iid: str, kind: str, records: Sequence[CallRecord], indexes: Sequence[int], what: str
) -> LinearizabilityViolation:
    listed = "; ".join(_call_name(i, records[i]) for i in indexes[:6])
    more = f"; and {len(indexes) - 6} more" if len(indexes) > 6 else ""
    return LinearizabilityViolation(iid, kind, f"{what}: {listed}{more}", tuple(indexes))


def _explain(
    iid: str, records: Sequence[CallRecord], ops: Sequence[SearchOp], search: Search, names: Names
) -> LinearizabilityViolation:
    """The violation for a failed search: how far the deepest explanation got, and why none of
    the calls due next fits there."""
    order, model = search.deepest()
    placed = {o.index for o in order if o.completed_at != INF}
    maybe = len(order) - len(placed)
    left = [o for o in search.definite if o.index not in placed]
    first_end = min(o.completed_at for o in left)
    due = [o for o in left if o.invoked_at <= first_end]
    head = (
        "no order of its calls explains what they returned. The deepest explanation found "
        f"places {len(placed)} of {len(search.definite)} completed call(s)"
    )
    if maybe:
        head += f" and takes {maybe} unknown call(s) as applied"
    if order:
        tail = "; ".join(_placed_name(o, records) for o in order[-3:])
        head += f", ending with {tail}"
    head += f". The instance is then at {names.model(model)}, and no call due next fits: "
    reasons = [
        f"{_call_name(o.index, records[o.index])}: {why_not(model, o, names)}" for o in due[:5]
    ]
    if len(due) > 5:
        reasons.append(f"and {len(due) - 5} more")
    involved = tuple(o.index for o in order[-3:]) + tuple(o.index for o in due[:5])
    return LinearizabilityViolation(iid, NOT_LINEARIZABLE, head + "; ".join(reasons), involved)


def _placed_name(o: SearchOp, records: Sequence[CallRecord]) -> str:
    name = _call_name(o.index, records[o.index])
    return name if o.completed_at != INF else f"{name} taken as applied"


def _call_name(index: int, r: CallRecord) -> str:
    end = "?" if r.outcome == "unknown" or r.completed_at is None else f"{r.completed_at:.6f}"
    return f"#{index} {r.label()} [{r.invoked_at:.6f}..{end}]"
