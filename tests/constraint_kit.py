"""What the cross-process constraint tests share: their workflows, and the proofs read back
from the database with the tests' own SQL (never through flowlock's code).

The workflows (module-level key functions: every process registers the same definition):

- ``review``: ``queued`` -> ``in_review`` (``start``, takes a slot of the reviewer, capacity
  ``LIMIT``) -> ``queued`` (``finish``, gives it back); ``reassign`` stays in ``in_review`` under
  the reviewer the payload names (the slot moves from one key to the other in one commit).
- ``subscription``: one instance per customer while ``active`` or ``suspended``.
- ``throttle``: ``ping`` keeps the instance ``open``, at most ``RATE`` per sku per second.
- ``desk``: ``idle`` -> ``busy`` (``take``) -> ``idle`` (``leave``), ``LIMIT`` busy per desk; a
  ``take`` waits for a free slot (``Capacity(wait=WAIT)``).

The proofs: :func:`slot_proof` replays a key's slot log (+1 / -1 in ``seq`` order) and holds the
slot rows, counters and instances to it; :func:`rate_proof` slides a window over the rate log.
"""

from __future__ import annotations

import sqlite3
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import flowlock
import pg_budget
from flowlock.core.definition import Step

__all__ = [
    "DESK_KIND",
    "LIMIT",
    "RATE",
    "RATE_PER",
    "REVIEW_KIND",
    "THROTTLE_KIND",
    "UNIQUE_KIND",
    "WAIT",
    "RateProof",
    "SlotProof",
    "desk",
    "rate_proof",
    "read_pg",
    "read_sqlite",
    "review",
    "slot_proof",
    "subscription",
    "throttle",
    "workflows",
]

LIMIT = 5  # slots per reviewer
RATE = 20  # pings per sku ...
RATE_PER = 1.0  # ... per this many seconds
WAIT = 30.0  # seconds a desk's take may wait for a slot (a generous bound)
REVIEW_KIND = "review.in_review"
DESK_KIND = "desk.busy"
UNIQUE_KIND = "subscription.unique"
THROTTLE_KIND = "throttle.ping.rate"


def reviewer(inst: flowlock.Instance) -> object:
    return inst.data["reviewer"]


def customer(inst: flowlock.Instance) -> object:
    return inst.data["customer_id"]


def sku(inst: flowlock.Instance) -> object:
    return inst.data["sku"]


def desk_of(inst: flowlock.Instance) -> object:
    return inst.data["desk"]


def _reassign(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    return Step(data={**inst.data, "reviewer": payload["reviewer"]})


def review(limit: int = LIMIT) -> flowlock.Workflow:
    """Reviews of a few reviewers, at most `limit` in review per reviewer."""
    in_review = flowlock.State("in_review", capacity=flowlock.Capacity(key=reviewer, limit=limit))
    return flowlock.Workflow(
        "review",
        states=["queued", in_review],
        initial="queued",
        transitions=[
            flowlock.Transition("start", source="queued", target=in_review),
            flowlock.Transition("finish", source="in_review", target="queued"),
            flowlock.Transition(
                "reassign", source="in_review", target="in_review", effect=_reassign
            ),
        ],
    )


def subscription() -> flowlock.Workflow:
    """One active (or suspended) subscription per customer."""
    return flowlock.Workflow(
        "subscription",
        states=["active", "suspended", "cancelled"],
        initial="active",
        unique=flowlock.Unique(key=customer, states=["active", "suspended"]),
        transitions=[
            flowlock.Transition("suspend", source="active", target="suspended"),
            flowlock.Transition("resume", source="suspended", target="active"),
            flowlock.Transition("cancel", source=["active", "suspended"], target="cancelled"),
        ],
    )


def throttle(limit: int = RATE, per: float = RATE_PER) -> flowlock.Workflow:
    """Pings of a sku, at most `limit` per `per` seconds over all of its instances."""
    rate = flowlock.Rate(key=sku, per=timedelta(seconds=per), limit=limit)
    return flowlock.Workflow(
        "throttle",
        states=["open"],
        initial="open",
        transitions=[flowlock.Transition("ping", source="open", target="open", rate=rate)],
    )


def desk(limit: int = LIMIT, wait: float = WAIT) -> flowlock.Workflow:
    """Desks of `limit` seats; a take waits up to `wait` seconds for a seat to free."""
    busy = flowlock.State("busy", capacity=flowlock.Capacity(key=desk_of, limit=limit, wait=wait))
    return flowlock.Workflow(
        "desk",
        states=["idle", busy],
        initial="idle",
        transitions=[
            flowlock.Transition("take", source="idle", target=busy),
            flowlock.Transition("leave", source="busy", target="idle"),
        ],
    )


def workflows() -> list[flowlock.Workflow]:
    """Every workflow of the tests, as each process registers them."""
    return [review(), subscription(), throttle(), desk()]


# -- the rows, read with the tests' own SQL ----------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """The constraint tables and the instances, as plain tuples.

    log: (kind, key, seq, instance_id, version, delta, holders, lim); slots: (kind, key,
    instance_id, version); counters: (kind, key, holders, lim, seq); instances: (id, workflow,
    state, version, data); history: (instance_id, version, event, actor); rates: (kind, key, at
    (epoch seconds), instance_id, version, lim, per).
    """

    log: list[tuple[str, str, int, str, int, int, int, int]]
    slots: list[tuple[str, str, str, int]]
    counters: list[tuple[str, str, int, int, int]]
    instances: list[tuple[str, str, str, int, dict[str, Any]]]
    history: list[tuple[str, int, str, str | None]]
    rates: list[tuple[str, str, float, str, int, int, float]]


_LOG = (
    "SELECT kind, key, seq, instance_id, version, delta, holders, lim FROM flowlock_slot_log"
    " ORDER BY kind, key, seq"
)
_SLOTS = "SELECT kind, key, instance_id, version FROM flowlock_slots"
_COUNTERS = "SELECT kind, key, holders, lim, seq FROM flowlock_capacity"
_HISTORY = "SELECT instance_id, version, event, actor FROM flowlock_history"


async def read_pg(url: str, schema: str) -> Rows:
    """The rows of `schema`, read in one repeatable-read transaction (one snapshot)."""
    import json

    conn = await pg_budget.connect(url)
    try:
        await conn.execute(f'SET search_path TO "{schema}"')
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            log = await conn.fetch(_LOG)
            slots = await conn.fetch(_SLOTS)
            counters = await conn.fetch(_COUNTERS)
            insts = await conn.fetch(
                "SELECT id, workflow, state, version, data::text AS data FROM flowlock_instances"
            )
            history = await conn.fetch(_HISTORY)
            rates = await conn.fetch(
                "SELECT kind, key, extract(epoch FROM at)::float8 AS at, instance_id, version,"
                " lim, per FROM flowlock_rate_log ORDER BY kind, key, at"
            )
    finally:
        await conn.close()
    return Rows(
        log=[tuple(r) for r in log],
        slots=[tuple(r) for r in slots],
        counters=[tuple(r) for r in counters],
        instances=[(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in insts],
        history=[tuple(r) for r in history],
        rates=[tuple(r) for r in rates],
    )


def read_sqlite(path: str) -> Rows:
    """The rows of the SQLite file at `path`, read in one transaction."""
    import json

    conn = sqlite3.connect(path, timeout=30)
    try:
        conn.execute("BEGIN")
        log = conn.execute(_LOG).fetchall()
        slots = conn.execute(_SLOTS).fetchall()
        counters = conn.execute(_COUNTERS).fetchall()
        insts = conn.execute(
            "SELECT id, workflow, state, version, data FROM flowlock_instances"
        ).fetchall()
        history = conn.execute(_HISTORY).fetchall()
        rates = conn.execute(
            "SELECT kind, key, at, instance_id, version, lim, per FROM flowlock_rate_log"
            " ORDER BY kind, key, at"
        ).fetchall()
        conn.execute("COMMIT")
    finally:
        conn.close()
    return Rows(
        log=log,
        slots=slots,
        counters=counters,
        instances=[(i, w, s, v, json.loads(d)) for i, w, s, v, d in insts],
        history=history,
        rates=rates,
    )


# -- the proofs ----------------------------------------------------------------------------------


@dataclass
class SlotProof:
    """What the replay of one kind's slot log found; `problems` is empty when it holds."""

    kind: str
    problems: list[str] = field(default_factory=list)
    events: int = 0
    takes: int = 0
    peak: dict[str, int] = field(default_factory=dict)  # the most holders each key ever had
    holders: dict[str, int] = field(default_factory=dict)  # slot rows per key now
    replayed: dict[str, tuple[int, int]] = field(default_factory=dict)  # (holders, seq) at end
    # Events after which a key was full with holders put there by more than one actor (the
    # workers' actors name their process): the limit was shared across processes.
    mixed_full: int = 0

    def assert_ok(self) -> None:
        assert not self.problems, "\n".join(self.problems[:30])


Event = tuple[str, str, int, str, int, int, int, int]


def slot_proof(
    rows: Rows,
    kind: str,
    limit: int,
    *,
    workflow: str = "review",
    key_of: Any = None,
    states: Sequence[str] = ("in_review",),
    takes: Sequence[str] = ("start", "reassign"),
    releases: Sequence[str] = ("finish", "reassign"),
    must_take: Sequence[str] = ("start",),
    must_release: Sequence[str] = ("finish",),
) -> SlotProof:
    """Replays the slot log of `kind` per key, +1 / -1 in `seq` order, and holds everything to it:

    - seq runs 1, 2, 3 ... per key, each event's recorded holders is the replayed count, which
      never goes below 0 nor above `limit` (nor the event's own recorded limit);
    - now: the slot rows per key number at most `limit`, equal the counter's holders, the
      replayed count, and (with `key_of`, a function of the data) the instances of `workflow`
      in `states` under that key, each of which holds a slot; the counter's seq is the log's last;
    - every take is a history row of an event in `takes` at the same version ("create" for
      version 1, the create's own), every release one in `releases`; every history row of an
      event in `must_take` has its take, of one in `must_release` its release (a reassign to the
      same key has neither: not required).
    """
    proof = SlotProof(kind)
    by_key: dict[str, list[Event]] = defaultdict(list)
    for event in rows.log:
        if event[0] == kind:
            by_key[event[1]].append(event)
    history = {(h[0], h[1]): (h[2], h[3]) for h in rows.history}
    for key, events in by_key.items():
        _replay(proof, key, events, limit, history, takes, releases)
    _now(proof, rows, by_key, limit)
    _every_row_logged(proof, rows, must_take, must_release)
    if key_of is not None:
        _instances(proof, rows, workflow, key_of, states)
    return proof


def _replay(
    proof: SlotProof,
    key: str,
    events: list[Event],
    limit: int,
    history: Mapping[tuple[str, int], tuple[str, str | None]],
    takes: Sequence[str],
    releases: Sequence[str],
) -> None:
    bad = proof.problems
    held = peak = 0
    by: dict[str, str | None] = {}  # holder -> the actor of its take
    for n, (_, _, seq, iid, version, delta, holders, lim) in enumerate(events, start=1):
        proof.events += 1
        proof.takes += delta == 1
        if seq != n:
            bad.append(f"{key}: event {n} has seq {seq} (the seqs skip or repeat)")
        if delta not in (1, -1):
            bad.append(f"{key} seq {seq}: delta {delta}")
        held += delta
        peak = max(peak, held)
        if held != holders:
            bad.append(f"{key} seq {seq}: recorded {holders} holders, the replay {held}")
        if held < 0 or held > limit or held > lim:
            bad.append(f"{key} seq {seq}: {held} holders, limit {limit} (recorded {lim})")
        event, actor = (
            ("create", None) if version == 1 else history.get((iid, version), (None, None))
        )
        if event not in (takes if delta == 1 else releases):
            bad.append(f"{key} seq {seq}: {iid} v{version} delta {delta} is event {event!r}")
        if delta == 1:
            by[iid] = actor
        else:
            by.pop(iid, None)
        if held == limit and len(set(by.values())) > 1:
            proof.mixed_full += 1
    proof.peak[key] = peak
    proof.replayed[key] = (held, len(events))


def _now(proof: SlotProof, rows: Rows, by_key: Mapping[str, list[Event]], limit: int) -> None:
    bad, kind = proof.problems, proof.kind
    counters = {c[1]: c for c in rows.counters if c[0] == kind}
    slots = Counter(s[1] for s in rows.slots if s[0] == kind)
    proof.holders = dict(slots)
    for key in set(by_key) | set(slots) | set(counters):
        held, seq = proof.replayed.get(key, (0, 0))
        n = slots.get(key, 0)
        counter = counters.get(key)
        if n > limit:
            bad.append(f"{key}: {n} slot rows, over the limit {limit}")
        if n != held:
            bad.append(f"{key}: {n} slot rows, the log replays to {held}")
        if counter is None:
            bad.append(f"{key}: no counter row ({n} slot rows, {seq} events)")
        elif (counter[2], counter[4]) != (held, seq) or counter[2] != n:
            bad.append(f"{key}: counter {counter}, {n} slot rows, the log replays to {held}/{seq}")


def _every_row_logged(
    proof: SlotProof, rows: Rows, must_take: Sequence[str], must_release: Sequence[str]
) -> None:
    logged = {(e[3], e[4], e[5]) for e in rows.log if e[0] == proof.kind}
    for iid, version, event, _ in rows.history:
        if event in must_take and (iid, version, 1) not in logged:
            proof.problems.append(f"{iid} v{version} ({event}) took no slot in the log")
        if event in must_release and (iid, version, -1) not in logged:
            proof.problems.append(f"{iid} v{version} ({event}) released no slot in the log")


def _instances(
    proof: SlotProof, rows: Rows, workflow: str, key_of: Any, states: Sequence[str]
) -> None:
    inside = [(iid, str(key_of(data))) for iid, wf, state, _, data in rows.instances
              if wf == workflow and state in states]  # fmt: skip
    per_key = Counter(key for _, key in inside)
    for key in set(per_key) | set(proof.holders):
        if per_key.get(key, 0) != proof.holders.get(key, 0):
            proof.problems.append(
                f"{key}: {per_key.get(key, 0)} instances in {list(states)}, "
                f"{proof.holders.get(key, 0)} slot rows"
            )
    holding = {(s[2], s[1]) for s in rows.slots if s[0] == proof.kind}
    for iid, key in inside:
        if (iid, key) not in holding:
            proof.problems.append(f"instance {iid} is in the states under {key} but holds no slot")


@dataclass
class RateProof:
    """The sliding window over one kind's rate log: the most counted in any window per key."""

    kind: str
    busiest: dict[str, int]
    events: int
    problems: list[str]

    def assert_ok(self) -> None:
        assert not self.problems, "\n".join(self.problems[:30])


def rate_proof(rows: Rows, kind: str, limit: int, per: float) -> RateProof:
    """For every counted application at t, the applications of its key in (t - per, t] number
    at most `limit`; each is a history row of the instance at that version."""
    by_key: dict[str, list[float]] = defaultdict(list)
    history = {(h[0], h[1]) for h in rows.history}
    problems: list[str] = []
    events = 0
    for k, key, at, iid, version, lim, p in rows.rates:
        if k != kind:
            continue
        events += 1
        by_key[key].append(at)
        if (lim, p) != (limit, per):
            problems.append(f"{key}: logged limit {lim} per {p}, the rule is {limit} per {per}")
        if (iid, version) not in history:
            problems.append(f"{key}: rate event of {iid} v{version} has no history row")
    busiest: dict[str, int] = {}
    window = round(per * 1_000_000)
    for key, times in by_key.items():
        # In whole microseconds (the server clock's resolution): no float rounding at the edge.
        micros = sorted(round(t * 1_000_000) for t in times)
        lo = 0
        most = 0
        for hi, t in enumerate(micros):
            while micros[lo] <= t - window:
                lo += 1
            inside = hi - lo + 1
            most = max(most, inside)
            if inside > limit:
                problems.append(
                    f"{key}: {inside} applications in the {per:g} s up to {t / 1e6:.6f} "
                    f"(limit {limit}): {[m / 1e6 for m in micros[lo : hi + 1]]}"
                )
        busiest[key] = most
    return RateProof(kind, busiest, events, problems)
