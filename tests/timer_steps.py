"""What the timer tests share: a workflow with a deadline and a reminder, and its bounds."""

from __future__ import annotations

from datetime import timedelta

import flowlock

# Every wait is bounded by this (seconds): generous, so a loaded machine only makes a test
# slower, while a hang still fails it.
BOUND = 30.0
QUIET = 0.3  # seconds a test waits to see that something does NOT happen
EVERY = 0.1  # a reminder's period: short, so that the tests that wait for it stay quick
LATER = 60.0  # an `after` that never comes due within a test
WF = "deadline"


def deadline(
    after: float = LATER, every: float | None = EVERY, limit: int = 3
) -> flowlock.Workflow:
    """An approval with a deadline (`expire`), a reminder while pending (`remind`), a way out
    of the state and back (`hold`, `resume`) and a transition that keeps it (`note`)."""
    transitions = [
        flowlock.Transition("approve", source="pending", target="approved"),
        flowlock.Transition(
            "expire", source="pending", target="rejected", after=timedelta(seconds=after)
        ),
        flowlock.Transition("hold", source="pending", target="held"),
        flowlock.Transition("resume", source="held", target="pending"),
        flowlock.Transition("note", source="pending", target="pending"),
    ]
    if every is not None:
        transitions.append(
            flowlock.Transition(
                "remind",
                source="pending",
                target="pending",
                every=timedelta(seconds=every),
                limit=limit,
            )
        )
    return flowlock.Workflow(
        WF,
        states=["pending", "approved", "rejected", "held"],
        initial="pending",
        transitions=transitions,
    )
