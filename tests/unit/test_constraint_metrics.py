"""What an operator sees of constraints in the metrics: refusals per rule, waits for a slot by
how they ended, and how long they took; a refusal's fire outcome stays `refused`."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

import flowlock
from flowlock.core.constraints import CapacityReached, RateLimited, UniqueViolation
from flowlock.core.errors import InvalidInput
from flowlock.metrics import CONSTRAINT_OUTCOMES, failure_outcome

KIND = "review.in_review"


def _metrics() -> tuple[flowlock.Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return flowlock.Metrics(registry=registry), registry


def test_a_refusal_is_counted_per_kind_and_rule() -> None:
    """flowlock_constraint_refusals_total{kind,rule} counts refusals; no wait is observed."""
    metrics, registry = _metrics()
    metrics.record_constraint(KIND, "capacity", "refused", None)
    metrics.record_constraint(KIND, "capacity", "refused", None)
    metrics.record_constraint("order.place.rate", "rate", "refused", None)
    sample = registry.get_sample_value
    assert sample("flowlock_constraint_refusals_total", {"kind": KIND, "rule": "capacity"}) == 2
    labels = {"kind": "order.place.rate", "rule": "rate"}
    assert sample("flowlock_constraint_refusals_total", labels) == 1
    assert sample("flowlock_constraint_wait_seconds_count", {"kind": KIND}) is None


def test_a_wait_that_timed_out_is_a_refusal_and_a_timeout() -> None:
    """A wait that ended refused counts as a refusal, a timed-out wait, and its seconds."""
    metrics, registry = _metrics()
    metrics.record_constraint(KIND, "capacity", "refused", 2.5)
    sample = registry.get_sample_value
    assert sample("flowlock_constraint_refusals_total", {"kind": KIND, "rule": "capacity"}) == 1
    timeout = {"kind": KIND, "outcome": "timeout"}
    assert sample("flowlock_constraint_waits_total", timeout) == 1
    assert sample("flowlock_constraint_wait_seconds_count", {"kind": KIND}) == 1
    assert sample("flowlock_constraint_wait_seconds_sum", {"kind": KIND}) == 2.5


def test_a_wait_that_ended_in_a_slot_is_no_refusal() -> None:
    """A wait that got its slot counts as a slot wait and its seconds, never as a refusal."""
    metrics, registry = _metrics()
    metrics.record_constraint(KIND, "capacity", "waited", 0.25)
    sample = registry.get_sample_value
    assert sample("flowlock_constraint_refusals_total", {"kind": KIND, "rule": "capacity"}) is None
    assert sample("flowlock_constraint_waits_total", {"kind": KIND, "outcome": "slot"}) == 1
    assert sample("flowlock_constraint_wait_seconds_bucket", {"kind": KIND, "le": "0.25"}) == 1


def test_an_unknown_outcome_is_refused_and_counts_nothing() -> None:
    """Only the outcomes named in CONSTRAINT_OUTCOMES are taken."""
    metrics, registry = _metrics()
    with pytest.raises(InvalidInput, match="refused, waited"):
        metrics.record_constraint(KIND, "capacity", "maybe", 1.0)
    assert CONSTRAINT_OUTCOMES == ("refused", "waited")
    assert (
        registry.get_sample_value("flowlock_constraint_wait_seconds_count", {"kind": KIND}) is None
    )


def test_a_refused_fire_is_labelled_refused() -> None:
    """A constraint's refusal is a business refusal in flowlock_transitions_total."""
    refusals = [
        CapacityReached(instance_id="a", kind=KIND, key="r", limit=2, holders=["b", "c"]),
        UniqueViolation(instance_id="a", kind="s.unique", key="c1", holder="b"),
        RateLimited(instance_id="a", kind="o.rate", key="k", limit=2, per=60.0, retry_after=3.0),
    ]
    assert [failure_outcome(exc) for exc in refusals] == ["refused"] * 3
