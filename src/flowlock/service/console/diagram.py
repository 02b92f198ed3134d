"""A workflow drawn as inline SVG on the server, the current state highlighted.

No script and no outside renderer: states are laid out left to right by their distance from
the initial state (every state is reachable, the definition checks it), each column ordered
by where its predecessors sit. Edges forward in that order are curves between columns; edges
back or within a column arc below; an event that keeps the state is a loop above its box.
Several events between the same two states share one edge and one label. Styling is in
console.css (classes only), so the page's CSP needs no inline styles.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from markupsafe import Markup, escape

from flowlock.core.definition import Workflow

__all__ = ["workflow_svg"]

_CHAR = 7.6  # px per character of a 13 px sans-serif label, a little generous
_BOX_H = 36
_ROW = 78
_GAP = 150  # between columns: room for a label
_PAD = 28
_LOOP_ROOM = 50  # above the first row, when a state has an event that keeps it
_BACK_ROOM = 56  # below the lowest row, when an edge goes back or within a column


@dataclass(frozen=True, slots=True)
class _Box:
    x: float
    y: float
    w: float

    @property
    def cy(self) -> float:
        return self.y + _BOX_H / 2


def _layers(wf: Workflow) -> dict[str, int]:
    out: dict[str, list[str]] = {s: [] for s in wf.states}
    for t in wf.transitions.values():
        for s in t.sources:
            out[s] += [d for d in t.targets if d not in out[s]]
    depth = {wf.initial: 0}
    queue = deque([wf.initial])
    while queue:
        s = queue.popleft()
        for d in out[s]:
            if d not in depth:
                depth[d] = depth[s] + 1
                queue.append(d)
    last = max(depth.values(), default=0)
    return {s: depth.get(s, last + 1) for s in wf.states}


def _edges(wf: Workflow) -> dict[tuple[str, str], list[str]]:
    labels: dict[tuple[str, str], list[str]] = {}
    for t in wf.transitions.values():
        name = f"{t.name} [guarded]" if t.guard is not None else t.name
        if t.timed:
            name += " [timer]"
        for s in t.sources:
            for d in t.targets:
                labels.setdefault((s, d), []).append(name)
    return labels


def _place(wf: Workflow, depth: dict[str, int], top: float) -> dict[str, _Box]:
    columns: dict[int, list[str]] = {}
    for s in wf.states:
        columns.setdefault(depth[s], []).append(s)
    row: dict[str, float] = {}
    preds: dict[str, list[str]] = {s: [] for s in wf.states}
    for (s, d), _ in _edges(wf).items():
        if depth[s] < depth[d]:
            preds[d].append(s)
    for col in sorted(columns):
        names = columns[col]
        # Each state goes near the mean row of its predecessors (fewer crossings), ties in the
        # definition's order.
        names.sort(key=lambda s: sum(row[p] for p in preds[s]) / len(preds[s]) if preds[s] else 0)
        for i, s in enumerate(names):
            row[s] = i
    boxes: dict[str, _Box] = {}
    x = _PAD + 34.0  # the start dot sits left of the first column
    for col in sorted(columns):
        width = max(len(s) * _CHAR + 28 for s in columns[col])
        for s in columns[col]:
            boxes[s] = _Box(x, top + row[s] * _ROW, width)
        x += width + _GAP
    return boxes


def _label(x: float, y: float, text: str) -> str:
    w = len(text) * 6.6 + 10
    return (
        f'<rect class="fl-elabel-bg" x="{x - w / 2:.1f}" y="{y - 10:.1f}" width="{w:.1f}" '
        f'height="18" rx="4"/><text class="fl-elabel" x="{x:.1f}" y="{y + 3:.1f}" '
        f'text-anchor="middle">{escape(text)}</text>'
    )


def _edge(a: _Box, b: _Box, text: str, kind: str, floor: float) -> tuple[str, str]:
    """The edge's path and its label, apart: labels are drawn last, over everything.

    `kind` is "loop", "forward", "column" (both in one column) or "back"; `floor` is the
    bottom of the lowest box, which back edges pass under."""
    if kind == "loop":
        x0, x1, y = a.x + a.w * 0.3, a.x + a.w * 0.7, a.y
        path = f"M{x0:.1f},{y:.1f} C{x0:.1f},{y - 34:.1f} {x1:.1f},{y - 34:.1f} {x1:.1f},{y:.1f}"
        lx, ly = (x0 + x1) / 2, y - 36
    elif kind == "forward":
        x0, y0, x1, y1 = a.x + a.w, a.cy, b.x, b.cy
        mid = (x0 + x1) / 2
        path = f"M{x0:.1f},{y0:.1f} C{mid:.1f},{y0:.1f} {mid:.1f},{y1:.1f} {x1:.1f},{y1:.1f}"
        lx, ly = mid, (y0 + y1) / 2
    elif kind == "column":
        down = b.y > a.y
        x = a.x + min(a.w, b.w) * 0.5
        y0 = a.y + _BOX_H if down else a.y
        y1 = b.y if down else b.y + _BOX_H
        path = f"M{x:.1f},{y0:.1f} L{x:.1f},{y1:.1f}"
        lx, ly = x + len(text) * 3.3 + 12, (y0 + y1) / 2
    else:
        x0, y0 = a.x + a.w / 2, a.y + _BOX_H
        x1, y1 = b.x + b.w / 2, b.y + _BOX_H
        # Under every box; longer arcs dip deeper, so arcs into one state keep apart.
        dip = floor + 34 + 0.1 * abs(x1 - x0)
        path = f"M{x0:.1f},{y0:.1f} C{x0:.1f},{dip:.1f} {x1:.1f},{dip:.1f} {x1:.1f},{y1:.1f}"
        lx, ly = (x0 + x1) / 2, (y0 + y1 + 6 * dip) / 8
    return f'<path class="fl-edge" d="{path}" marker-end="url(#fl-arrow)"/>', _label(lx, ly, text)


def _kind(s: str, d: str, depth: dict[str, int]) -> str:
    if s == d:
        return "loop"
    if depth[s] < depth[d]:
        return "forward"
    return "column" if depth[s] == depth[d] else "back"


def _state(wf: Workflow, name: str, box: _Box, current: str | None) -> str:
    classes = ["fl-state"]
    if name == current:
        classes.append("fl-current")
    if wf.is_final(name):
        classes.append("fl-final")
    inner = ""
    if wf.is_final(name):
        inner = (
            f'<rect class="fl-final-ring" x="{box.x + 3:.1f}" y="{box.y + 3:.1f}" '
            f'width="{box.w - 6:.1f}" height="{_BOX_H - 6}" rx="7"/>'
        )
    title = f"{name} (current state)" if name == current else name
    return (
        f'<g class="{" ".join(classes)}" data-state="{escape(name)}"><title>{escape(title)}</title>'
        f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{_BOX_H}" rx="10"/>'
        f'{inner}<text x="{box.x + box.w / 2:.1f}" y="{box.cy + 4.5:.1f}" '
        f'text-anchor="middle">{escape(name)}</text></g>'
    )


def workflow_svg(wf: Workflow, current: str | None = None) -> Markup:
    """`wf` as an `<svg>` element; the state `current` (if any) carries class `fl-current`."""
    depth = _layers(wf)
    edges = _edges(wf)
    kinds = {pair: _kind(*pair, depth) for pair in edges}
    loops = "loop" in kinds.values()
    boxes = _place(wf, depth, _PAD + (_LOOP_ROOM if loops else 0))
    floor = max(b.y for b in boxes.values()) + _BOX_H
    paths: list[str] = []
    labels: list[str] = []
    back = 0.0
    for (s, d), names in edges.items():
        kind = kinds[(s, d)]
        if kind == "back":
            back = max(back, abs(boxes[s].x - boxes[d].x))
        path, label = _edge(boxes[s], boxes[d], ", ".join(names), kind, floor)
        paths.append(path)
        labels.append(label)
    parts = paths
    first = boxes[wf.initial]
    parts.append(
        f'<circle class="fl-start" cx="{first.x - 26:.1f}" cy="{first.cy:.1f}" r="7"/>'
        f'<path class="fl-edge" d="M{first.x - 19:.1f},{first.cy:.1f} H{first.x:.1f}" '
        'marker-end="url(#fl-arrow)"/>'
    )
    parts += [_state(wf, s, boxes[s], current) for s in wf.states]
    parts += labels
    width = max(b.x + b.w for b in boxes.values()) + _PAD
    height = floor + _PAD + (_BACK_ROOM + 0.1 * back if back else 0)
    defs = (
        '<defs><marker id="fl-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path class="fl-arrowhead" '
        'd="M0,0 L10,5 L0,10 z"/></marker></defs>'
    )
    label = f"State diagram of workflow {wf.name}" + (
        f", current state {current}" if current else ""
    )
    return Markup(
        f'<svg class="fl-diagram" xmlns="http://www.w3.org/2000/svg" role="img" '
        f'aria-label="{escape(label)}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'width="{width:.0f}" height="{height:.0f}">{defs}{"".join(parts)}</svg>'
    )
