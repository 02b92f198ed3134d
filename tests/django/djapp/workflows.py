"""The workflows FLOWLOCK['WORKFLOWS'] names (a module: every Workflow in it)."""

from __future__ import annotations

import flowlock

approval = flowlock.Workflow(
    "approval",
    states=["pending", "approved", "rejected", "archived"],
    initial="pending",
    transitions=[
        flowlock.Transition("approve", source="pending", target="approved"),
        flowlock.Transition("reject", source="pending", target="rejected"),
        flowlock.Transition("archive", source=["approved", "rejected"], target="archived"),
    ],
)

# A self-loop: every call applies, so concurrent callers each add one version.
tally = flowlock.Workflow(
    "tally",
    states=["open", "closed"],
    initial="open",
    transitions=[
        flowlock.Transition("count", source="open", target="open"),
        flowlock.Transition("close", source="open", target="closed"),
    ],
)

# Paused and resumed whole by the admin's tests, and used by nothing else.
errand = flowlock.Workflow(
    "errand",
    states=["todo", "done"],
    initial="todo",
    transitions=[flowlock.Transition("finish", source="todo", target="done")],
)
