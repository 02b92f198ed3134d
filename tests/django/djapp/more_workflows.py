"""Workflow paths of other shapes, for the settings tests: one Workflow, a list, a callable."""

from __future__ import annotations

import flowlock

one = flowlock.examples.approval("one")
several = [flowlock.examples.approval("two"), flowlock.examples.approval("three")]


def made() -> list[flowlock.Workflow]:
    return [flowlock.examples.approval("four")]


not_a_workflow = 42
