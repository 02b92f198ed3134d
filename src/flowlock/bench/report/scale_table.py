"""`flowlock bench --scale` as a rich table and as JSON, read from its report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flowlock.bench.scale_results import SLOPE_AIMS, THROUGHPUTS, ScaleReport

__all__ = ["render_scale", "scale_json", "write_scale_json"]


def _size(n: int) -> str:
    """10^k for a power of ten, else the count with separators."""
    k = len(str(n)) - 1
    return f"10^{k}" if n == 10**k else f"{n:,}"


def _unit(metric: str) -> str:
    if metric in THROUGHPUTS:
        return "applied/s"
    if metric.startswith("flowlock_"):
        return "MB"
    return "ms"


def _value(metric: str, value: float | None) -> str:
    if value is None:
        return "—"
    if metric.startswith("flowlock_"):
        return f"{value / 1_048_576:,.1f}"
    if metric in THROUGHPUTS:
        return f"{value:,.0f}"
    return f"{value:,.2f}"


def _aim(report: ScaleReport, metric: str) -> Text:
    limit = SLOPE_AIMS.get(metric)
    slope = report.slope(metric)
    if limit is None or slope is None:
        return Text("")
    met = slope <= limit
    return Text(f"<= {limit:g}x {'met' if met else 'NOT met'}", style="green" if met else "red")


def render_scale(report: ScaleReport, console: Console) -> None:
    """One row per figure: its value at each size, the slope, and the aim where there is one."""
    table = Table(
        title=(
            f"flowlock bench --scale: cost against size (PostgreSQL {report.postgres_version}, "
            f"{report.database}, {report.cores} cores{', quick' if report.quick else ''})"
        ),
        box=box.SIMPLE_HEAD,
    )
    table.add_column("figure")
    table.add_column("unit")
    for size in report.sizes:
        table.add_column(_size(size), justify="right")
    table.add_column("slope", justify="right")
    table.add_column("aim")
    table.add_row(
        "history rows", "rows", *(f"{h:,}" for h in report.history_rows), "", "", end_section=False
    )
    table.add_row("load", "s", *(f"{s:,.1f}" for s in report.load_s), "", "", end_section=True)
    for metric in report.metrics():
        slope = report.slope(metric)
        table.add_row(
            metric,
            _unit(metric),
            *(_value(metric, f.get(metric)) for f in report.figures),
            "—" if slope is None else f"{slope:.2f}x",
            _aim(report, metric),
        )
    console.print(table)
    console.print(
        "slope: the largest size's figure over the smallest's (for applied/s the smallest's "
        "over the largest's): how many times costlier a call is there. Tables: heap and "
        f"indexes. Each size is a schema of its own, measured in {report.args.get('rounds')} "
        "rounds taken in turn with the other sizes; each figure is the median of its rounds. "
        f"A round: {report.args.get('fires')} sequential fires on random instances (p50, p99), "
        f"each query {report.args.get('query_repeats')} times (median). "
        f"Seed {report.seed}; {report.duration_s:,.0f} s in all."
    )


def scale_json(report: ScaleReport) -> dict[str, Any]:
    """The report as a JSON document (units: ms, applied/s, bytes, seconds)."""
    metrics = {
        metric: {
            "unit": "bytes" if metric.startswith("flowlock_") else _unit(metric),
            "values": [f.get(metric) for f in report.figures],
            "rounds": [[r.get(metric) for r in per_size] for per_size in report.rounds],
            "slope": report.slope(metric),
            "aim_slope": SLOPE_AIMS.get(metric),
        }
        for metric in report.metrics()
    }
    return {
        "kind": "scale",
        "flowlock_version": report.flowlock_version,
        "postgres_version": report.postgres_version,
        "cores": report.cores,
        "database": report.database,
        "duration_s": report.duration_s,
        "args": report.args,
        "sizes": list(report.sizes),
        "history_rows": list(report.history_rows),
        "load_s": list(report.load_s),
        "metrics": metrics,
        "log": list(report.log),
        "aims": [
            {
                "metric": metric,
                "slope": report.slope(metric),
                "at_most": limit,
                "met": (s := report.slope(metric)) is not None and s <= limit,
            }
            for metric, limit in SLOPE_AIMS.items()
        ],
    }


def write_scale_json(report: ScaleReport, path: Path) -> None:
    """Write `scale_json(report)` to `path`."""
    path.write_text(json.dumps(scale_json(report), indent=2) + "\n", encoding="utf-8")
