"""Prometheus metrics on an injected registry; nothing is registered globally by default.

Base units (seconds) and `_total` counters. Labels are bounded by the definitions:
workflow, event, strategy, outcome. No instance id label: it would make a series per
instance.
"""

from __future__ import annotations

import re

from flowlock.core.extras import require

require("prometheus_client", "metrics", "flowlock.Metrics")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flowlock.core.errors import (
    ConflictRetriesExhausted,
    FlowlockError,
    InvalidInput,
    LockLost,
)
from flowlock.core.models import Outcome
from flowlock.core.outcomes import OUTCOMES, failure_outcome

__all__ = ["CONSTRAINT_OUTCOMES", "OUTCOMES", "Metrics", "failure_outcome"]

_PREFIX = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]{0,99}")

CONSTRAINT_OUTCOMES = ("refused", "waited")
"""What `Metrics.record_constraint` takes: a refusal, or a wait that ended in a slot."""

# Waits for a slot last up to MAX_WAIT (300 s).
_WAITS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The collectors of one engine.

    `registry` defaults to a private CollectorRegistry. Pass `prometheus_client.REGISTRY`
    to expose them on the process's default endpoint.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, prefix: str = "flowlock"
    ) -> None:
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise InvalidInput(
                "registry must be a prometheus_client CollectorRegistry, not "
                f"{type(registry).__name__}"
            )
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            raise InvalidInput(
                f"prefix {prefix!r} is not a Prometheus metric name: a letter, '_' or ':', then "
                "letters, digits, '_' or ':' (at most 100 characters)"
            )
        self.registry = registry if registry is not None else CollectorRegistry()
        try:
            self._register(self.registry, prefix)
            self._register_outbox(self.registry, prefix)
            self._register_constraints(self.registry, prefix)
        except ValueError as exc:  # prometheus_client: a name already taken in the registry
            raise InvalidInput(
                f"the registry already has flowlock metrics named {prefix}_*: {exc}; give each "
                "engine its own registry or prefix"
            ) from None

    def _register(self, r: CollectorRegistry, p: str) -> None:
        self.transitions = Counter(
            f"{p}_transitions", "fire() calls by how they ended.",
            ["workflow", "event", "strategy", "outcome"], registry=r,
        )  # fmt: skip
        self.conflicts = Counter(
            f"{p}_conflicts", "Lost version compare-and-swaps (each one cost a retry).",
            ["workflow", "strategy"], registry=r,
        )  # fmt: skip
        self.attempts = Histogram(
            f"{p}_attempts", "Attempts (step runs) per fire() call.",
            ["strategy"], buckets=(1, 2, 3, 5, 10, 20, 50), registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            f"{p}_transition_duration_seconds", "Time spent in fire().",
            ["workflow", "strategy"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.lock_wait = Histogram(
            f"{p}_lock_wait_seconds", "Time waiting for a row lock or a lease.",
            ["strategy"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.lock_hold = Histogram(
            f"{p}_lock_hold_seconds", "Time a row lock or a lease was held.",
            ["strategy"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.escalations = Counter(
            f"{p}_escalations", "Instances escalated by the adaptive strategy.",
            ["to"], registry=r,
        )  # fmt: skip
        self.deescalations = Counter(
            f"{p}_deescalations", "Escalated instances that stepped back down to optimistic.",
            registry=r,
        )  # fmt: skip
        self.escalated_keys = Gauge(
            f"{p}_escalated_keys", "Instances currently escalated (in this engine).", registry=r
        )
        self.leases_lost = Counter(
            f"{p}_leases_lost", "Leases lost before commit (the write was refused).",
            ["strategy"], registry=r,
        )  # fmt: skip
        self.timer_lag = Histogram(
            f"{p}_timer_lag_seconds", "Seconds from a timer's due time to its firing.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )  # fmt: skip
        self.timer_firings = Counter(
            f"{p}_timer_firings", "Timer firings by outcome (applied, idempotent, stale, "
            "refused, cancelled, failed).", ["outcome"], registry=r,
        )  # fmt: skip
        self.timers_armed = Gauge(
            f"{p}_timers_armed", "Timers armed in the store, as last counted by this engine.",
            registry=r,
        )  # fmt: skip

    def _register_outbox(self, r: CollectorRegistry, p: str) -> None:
        self.outbox_pending = Gauge(
            f"{p}_outbox_pending", "Outbox messages not delivered yet (pending or running), "
            "as last counted by this engine.", registry=r,
        )  # fmt: skip
        self.outbox_dead = Gauge(
            f"{p}_outbox_dead", "Outbox messages given up (dead), as last counted by this "
            "engine.", registry=r,
        )  # fmt: skip
        self.outbox_lag = Histogram(
            f"{p}_outbox_dispatch_lag_seconds", "Seconds from a message's commit to its claim "
            "for delivery.", ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )  # fmt: skip
        self.outbox_deliveries = Counter(
            f"{p}_outbox_deliveries", "Outbox deliveries by how they ended (done, then, "
            "retried, dead).", ["kind", "outcome"], registry=r,
        )  # fmt: skip
        self.outbox_attempts = Counter(
            f"{p}_outbox_attempts", "Outbox deliveries begun (each attempt).", ["kind"],
            registry=r,
        )  # fmt: skip

    def _register_constraints(self, r: CollectorRegistry, p: str) -> None:
        self.constraint_refusals = Counter(
            f"{p}_constraint_refusals", "Transitions and creates a constraint refused (capacity, "
            "unique, rate), a wait that timed out included.", ["kind", "rule"], registry=r,
        )  # fmt: skip
        self.constraint_waits = Counter(
            f"{p}_constraint_waits", "Waits for a slot (Capacity(wait=)) by how they ended: "
            "slot (it fit) or timeout (refused).", ["kind", "outcome"], registry=r,
        )  # fmt: skip
        self.constraint_wait = Histogram(
            f"{p}_constraint_wait_seconds", "Seconds a call waited for a slot, however it ended.",
            ["kind"], buckets=_WAITS, registry=r,
        )  # fmt: skip

    def record_constraint(self, kind: str, rule: str, outcome: str, waited: float | None) -> None:
        """A constraint's answer to one call: `outcome` "refused" (after a wait of `waited`
        seconds that timed out, or at once when None) or "waited" (a wait of `waited` seconds
        ended in a slot). `rule`: capacity, unique or rate; `kind`: the rule's name."""
        if outcome not in CONSTRAINT_OUTCOMES:
            raise InvalidInput(
                f"constraint outcome {outcome!r} is not one of {', '.join(CONSTRAINT_OUTCOMES)}"
            )
        if outcome == "refused":
            self.constraint_refusals.labels(kind, rule).inc()
        if waited is not None:
            ended = "slot" if outcome == "waited" else "timeout"
            self.constraint_waits.labels(kind, ended).inc()
            self.constraint_wait.labels(kind).observe(max(0.0, waited))

    def record_outbox_claim(self, kind: str, lag: float) -> None:
        """A delivery of a `kind` message begun, `lag` seconds after its commit."""
        self.outbox_attempts.labels(kind).inc()
        self.outbox_lag.labels(kind).observe(lag)

    def record_outbox_delivery(self, kind: str, outcome: str) -> None:
        """A delivery that came to `outcome` (see `flowlock.outbox.dispatcher.OUTCOMES`)."""
        self.outbox_deliveries.labels(kind, outcome).inc()

    def record_outbox_counts(self, *, pending: int, dead: int) -> None:
        """How many messages the store holds not delivered yet, and dead, as last counted."""
        self.outbox_pending.set(pending)
        self.outbox_dead.set(dead)

    def record_timer(self, outcome: str, lag: float | None) -> None:
        """One timer firing that came to `outcome` (see `flowlock.timers.OUTCOMES`); `lag`:
        seconds from its due time to its firing, when it applied."""
        self.timer_firings.labels(outcome).inc()
        if lag is not None:
            self.timer_lag.observe(lag)

    def record_timers_armed(self, count: int) -> None:
        """How many timers the store holds, as last counted."""
        self.timers_armed.set(count)

    def record_outcome(
        self, outcome: Outcome, *, lock_wait: float | None = None, lock_hold: float | None = None
    ) -> None:
        """A `fire` call that returned `outcome`.

        `lock_wait` and `lock_hold` are seconds, given when its strategy took a lock.
        """
        workflow, strategy = outcome.instance.workflow, outcome.strategy
        label = "applied" if outcome.applied else "idempotent"
        self.transitions.labels(workflow, outcome.event, strategy, label).inc()
        self.attempts.labels(strategy).observe(outcome.attempts)
        self.duration.labels(workflow, strategy).observe(outcome.elapsed)
        if outcome.attempts > 1 and strategy == "optimistic":
            self.conflicts.labels(workflow, strategy).inc(outcome.attempts - 1)
        if lock_wait is not None:
            self.lock_wait.labels(strategy).observe(lock_wait)
        if lock_hold is not None:
            self.lock_hold.labels(strategy).observe(lock_hold)

    def record_failure(
        self, exc: FlowlockError, *, workflow: str, event: str, strategy: str, elapsed: float
    ) -> None:
        """A `fire` call that raised `exc` after `elapsed` seconds.

        `workflow` is "" when the call failed before reading its instance.
        """
        label = failure_outcome(exc)
        if isinstance(exc, ConflictRetriesExhausted):
            self.conflicts.labels(workflow, strategy).inc(exc.attempts)
        elif isinstance(exc, LockLost):
            self.leases_lost.labels(strategy).inc()
        self.transitions.labels(workflow, event, strategy, label).inc()
        self.duration.labels(workflow, strategy).observe(elapsed)

    def record_escalations(self, *, active: int, escalated: int, deescalated: int, to: str) -> None:
        """One escalation-sync tick.

        `active` keys are escalated now. `escalated` (to strategy `to`) and
        `deescalated` are the changes since the previous tick.
        """
        self.escalated_keys.set(active)
        self.escalations.labels(to).inc(escalated)
        self.deescalations.inc(deescalated)
