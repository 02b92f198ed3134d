"""What the timer tests share: a timed approval workflow, a check that every timer firing in a
history applied inside the stay that armed it and at most once, and the timer service's firings
counted from an engine's metrics.

The workflow (``deadline``) is the issue's approval with a deadline:

- ``pending`` -> ``approved`` (``approve``, a caller) or ``rejected`` (``expire``, a timer
  ``after`` into the stay; its guard refuses while the data says ``{"hold": true}``);
- ``remind`` (optional): ``pending`` -> ``pending`` ``every`` period, at most ``limit`` times; its
  guard refuses while the data says ``{"quiet": true}``, and ``speak`` (a caller, keeping the
  state: the stay goes on) clears that;
- ``pause`` / ``resume``: leave ``pending`` for ``held`` and come back (a new stay);
- ``submit``: ``draft`` -> ``pending`` (a caller's transition that arms the deadline),
  ``withdraw`` back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import flowlock
from flowlock.core.models import TIMER_ACTOR, HistoryEntry
from flowlock.metrics import Metrics
from flowlock.timers import OUTCOMES
from lock_probes import wait_until

__all__ = ["deadline", "due_of", "fired", "firings", "stay_violations"]


def _not_held(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    if inst.data.get("hold"):
        raise flowlock.GuardRejected("on hold: the deadline does not apply")
    return True


def _not_quiet(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    if inst.data.get("quiet"):
        raise flowlock.GuardRejected("quiet: no reminder now")
    return True


def _speak(
    inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None
) -> dict[str, Any]:
    return {**inst.data, "quiet": False}


def deadline(
    *,
    after: float | None = 0.3,
    every: float | None = None,
    limit: int | None = None,
    initial: str = "pending",
    name: str = "deadline",
    on_expire: Callable[[flowlock.Instance], None] | None = None,
) -> flowlock.Workflow:
    """The approval with a deadline `after` seconds into `pending` (None: no deadline), and a
    reminder every `every` seconds (None: none), at most `limit` of them. `on_expire` is called
    by the deadline's effect (a multi-process test records which process fired, and when)."""

    def expired(
        inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None
    ) -> dict[str, Any]:
        if on_expire is not None:
            on_expire(inst)
        return dict(inst.data)

    transitions = [
        flowlock.Transition("approve", source="pending", target="approved"),
        flowlock.Transition("pause", source="pending", target="held"),
        flowlock.Transition("resume", source="held", target="pending"),
        flowlock.Transition("submit", source="draft", target="pending"),
        flowlock.Transition("withdraw", source="pending", target="draft"),
        flowlock.Transition(
            "expire",
            source="pending",
            target="rejected",
            guard=_not_held,
            effect=expired,
            after=None if after is None else timedelta(seconds=after),
        ),
    ]
    if every is not None:
        transitions += [
            flowlock.Transition(
                "remind",
                source="pending",
                target="pending",
                guard=_not_quiet,
                every=timedelta(seconds=every),
                limit=limit,
            ),
            flowlock.Transition("speak", source="pending", target="pending", effect=_speak),
        ]
    return flowlock.Workflow(
        name,
        states=["draft", "pending", "held", "approved", "rejected"],
        initial=initial,
        transitions=transitions,
    )


def due_of(created: flowlock.Instance, after: float) -> float:
    """When a timer `after` seconds into the first stay of `created` falls due, in seconds since
    the epoch on the server's clock: it is armed by the create's statement, whose now() is the
    instance's `created_at`."""
    assert created.created_at is not None
    return created.created_at.timestamp() + after


def stay_violations(history: Sequence[HistoryEntry], *, created_stay: int = 1) -> list[str]:
    """Every way `history` (one instance's, any order) breaks the timers' promise: a timer's row
    whose request id is not ``timer:<stay>:<event>:<n>`` of the stay the instance was in when it
    applied (a firing outside its stay), or the same firing applied twice. Empty when clean."""
    found: list[str] = []
    stay = created_stay
    seen: set[tuple[int, str, int]] = set()
    for entry in sorted(history, key=lambda e: e.version):
        if entry.actor == TIMER_ACTOR:
            parts = (entry.request_id or "").split(":")
            if len(parts) != 4 or parts[0] != "timer" or parts[2] != entry.event:
                found.append(
                    f"version {entry.version}: timer row with request id {entry.request_id!r}"
                )
            else:
                firing = (int(parts[1]), parts[2], int(parts[3]))
                if firing[0] != stay:
                    found.append(
                        f"version {entry.version}: {entry.request_id} applied in the stay that "
                        f"began at version {stay}"
                    )
                if firing in seen:
                    found.append(f"version {entry.version}: {entry.request_id} applied twice")
                seen.add(firing)
        if entry.from_state != entry.to_state:
            stay = entry.version
    return found


def firings(*metrics: Metrics | None) -> dict[str, int]:
    """The timer firings the engines of `metrics` recorded, by outcome (summed)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for m in metrics:
        assert m is not None
        for outcome in OUTCOMES:
            value = m.registry.get_sample_value(
                "flowlock_timer_firings_total", {"outcome": outcome}
            )
            counts[outcome] += int(value or 0)
    return counts


async def fired(n: int, *metrics: Metrics | None, within: float = 30.0) -> dict[str, int]:
    """Wait until the engines of `metrics` recorded `n` applied firings, then hold them to
    exactly `n`; the firings by outcome. (A firing is counted just after its commit: its row
    may be read a moment before.)"""
    await wait_until(
        lambda: firings(*metrics)["applied"] >= n, within=within, what=f"{n} applied firings"
    )
    counts = firings(*metrics)
    assert counts["applied"] == n, counts
    return counts
