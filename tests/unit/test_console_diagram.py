"""The console's server-side diagram (SVG from a Workflow) and the monitor's two reads for it."""

from __future__ import annotations

import re
from datetime import timedelta
from xml.etree import ElementTree

from flowlock.core.definition import Transition, Workflow
from flowlock.examples import approval, countersign
from flowlock.service.console.diagram import workflow_svg
from flowlock.strategies.monitor import ConflictMonitor

SVG = "{http://www.w3.org/2000/svg}"


def _order() -> Workflow:
    return Workflow(
        "order",
        states=["draft", "review", "done", "cancelled"],
        initial="draft",
        transitions=[
            Transition("submit", source="draft", target="review"),
            Transition("send_back", source="review", target="draft"),
            Transition("remind", source="review", target="review", after=timedelta(hours=1)),
            Transition("finish", source="review", target="done", guard=lambda i, p, a: True),
            Transition("cancel", source=["draft", "review"], target="cancelled"),
        ],
    )


def test_every_state_is_drawn_once_and_only_the_current_one_is_highlighted() -> None:
    svg = ElementTree.fromstring(str(workflow_svg(_order(), "review")))
    groups = svg.findall(f"{SVG}g")
    assert sorted(g.get("data-state") or "" for g in groups) == sorted(_order().states)
    current = [g.get("data-state") for g in groups if "fl-current" in (g.get("class") or "")]
    assert current == ["review"]
    finals = [g.get("data-state", "") for g in groups if "fl-final" in g.get("class", "")]
    assert sorted(finals) == ["cancelled", "done"]


def test_every_edge_is_drawn_with_its_events_as_the_label() -> None:
    svg = str(workflow_svg(_order()))
    labels = re.findall(r'<text class="fl-elabel"[^>]*>([^<]+)</text>', svg)
    assert sorted(labels) == sorted(
        ["submit", "send_back", "remind [timer]", "finish [guarded]", "cancel", "cancel"]
    )
    # One path per (source, target) pair, plus the arrow from the start dot.
    assert svg.count('class="fl-edge"') == 6 + 1
    assert "fl-current" not in svg


def test_names_are_escaped() -> None:
    wf = approval("weird")
    svg = str(workflow_svg(wf, "pending"))
    ElementTree.fromstring(svg)  # well-formed
    loop = str(workflow_svg(countersign(2), "pending"))
    assert "sign [guarded]" in loop
    assert "<script" not in svg


def test_the_monitor_lists_escalations_and_hot_keys_without_stepping_anything_down() -> None:
    now = [0.0]
    monitor = ConflictMonitor(min_samples=10, window=20, cooldown=5.0, clock=lambda: now[0])
    monitor.record("hot", conflict=True)
    for n in range(12):
        monitor.record("hot", conflict=n % 2 == 0)
    monitor.record("warm", conflict=True)
    for n in range(4):
        monitor.record("warm", conflict=n == 0)
    [(escalation, left)] = monitor.escalations_now()
    assert escalation.key == "hot" and left == 5.0
    # Highest rate first; "hot" began a fresh window when it escalated.
    assert monitor.hot_keys() == [("warm", 1, 4), ("hot", 0, 1)]
    assert monitor.hot_keys(1) == [("warm", 1, 4)]
    now[0] = 6.0
    assert monitor.escalations_now() == []
    assert monitor.active_count == 1  # stepping down is the next call's business, not a read's
