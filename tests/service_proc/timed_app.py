"""The workflow ``flowlock serve --app timed_app:workflows`` serves in the timer tests: an
approval that expires by itself 100 ms into its stay."""

from __future__ import annotations

from datetime import timedelta

import flowlock


def workflows() -> list[flowlock.Workflow]:
    return [
        flowlock.Workflow(
            "quick",
            states=["pending", "approved", "rejected"],
            initial="pending",
            transitions=[
                flowlock.Transition("approve", source="pending", target="approved"),
                flowlock.Transition(
                    "expire",
                    source="pending",
                    target="rejected",
                    after=timedelta(milliseconds=100),
                ),
            ],
        )
    ]
