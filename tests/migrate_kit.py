"""The migration tests' workflow in two versions (tests/unit/test_migrate.py,
tests/integration/test_migrate_pg.py and its deploy worker process).

`case` version 1 has the states open, held, closed; version 2 renames open to `active` and
closed to `done` (so a migration needs MAP) and adds `reopen`. Each version's `bump` keeps
the state, counts in `data["n"]` and writes which version's code ran into `data["ran"]`: a
row decided under one version by the other's code shows in its data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flowlock
from flowlock import Step, Transition, Workflow

TICKET = "case"
MAP = {"open": "active", "closed": "done"}


def bump_v1(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    data = {**inst.data, "n": int(inst.data.get("n", 0)) + 1, "ran": 1}
    return Step(data=data, target=inst.state)


def bump_v2(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Step:
    data = {**inst.data, "n": int(inst.data.get("n", 0)) + 1, "ran": 2}
    return Step(data=data, target=inst.state)


def ticket_v1() -> Workflow:
    return Workflow(
        TICKET,
        # bump stays in its state and must apply: adaptive, as the engine advises.
        strategy="adaptive",
        states=["open", "held", "closed"],
        initial="open",
        transitions=[
            Transition("bump", source=["open", "held"], target=["open", "held"], effect=bump_v1),
            Transition("hold", source="open", target="held"),
            Transition("close", source=["open", "held"], target="closed"),
        ],
    )


def ticket_v2() -> Workflow:
    return Workflow(
        TICKET,
        strategy="adaptive",
        states=["active", "held", "done"],
        initial="active",
        transitions=[
            Transition(
                "bump", source=["active", "held"], target=["active", "held"], effect=bump_v2
            ),
            Transition("hold", source="active", target="held"),
            Transition("reopen", source="held", target="active"),
            Transition("close", source=["active", "held"], target="done"),
        ],
    )


def case_ids(n: int) -> list[str]:
    """The ids of the PostgreSQL tests' `n` instances (the deploy worker builds the same)."""
    return [f"c-{i:05d}" for i in range(n)]


def both() -> list[Workflow]:
    """What `flowlock admin migrate --app migrate_kit:both` registers: both versions."""
    return [ticket_v1(), ticket_v2()]


def ran_under_own_version(rows: list[flowlock.HistoryEntry]) -> list[str]:
    """Rows whose `bump` ran the code of another version than the row says it was decided
    with (empty: none)."""
    return [
        f"version {r.version}: ran v{r.data.get('ran')} code, recorded v{r.definition_version}"
        for r in rows
        if r.event == "bump" and r.data.get("ran") != r.definition_version
    ]
