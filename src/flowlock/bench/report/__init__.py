"""Rendering a `BenchReport`: tables, JSON, chart and progress.

It only reads results and the strategy registry; it measures and runs nothing.
"""

from __future__ import annotations

from flowlock.bench.report.aims import (
    AIMS,
    FLOOR,
    FLOOR_METHOD,
    Aim,
    AimSpec,
    aims,
    floors,
    vs_floor,
)
from flowlock.bench.report.cells import fitting
from flowlock.bench.report.chart import (
    PlotUnavailable,
    chart_title,
    check_plot_support,
    figure,
    plot,
)
from flowlock.bench.report.json import result_to_json, to_json, write_json
from flowlock.bench.report.progress import OVERALL, EtaColumn, RichProgress
from flowlock.bench.report.tables import (
    SEED_COUNTERPART,
    SEED_MEASURED,
    SEED_PUBLISHED,
    SeedFigures,
    aims_layouts,
    aims_table,
    render,
    results_layouts,
    results_table,
    seed_layouts,
    seed_table,
)
from flowlock.bench.results import failures

__all__ = [
    "AIMS",
    "FLOOR",
    "FLOOR_METHOD",
    "OVERALL",
    "SEED_COUNTERPART",
    "SEED_MEASURED",
    "SEED_PUBLISHED",
    "Aim",
    "AimSpec",
    "EtaColumn",
    "PlotUnavailable",
    "RichProgress",
    "SeedFigures",
    "aims",
    "aims_layouts",
    "aims_table",
    "chart_title",
    "check_plot_support",
    "failures",
    "figure",
    "fitting",
    "floors",
    "plot",
    "render",
    "result_to_json",
    "results_layouts",
    "results_table",
    "seed_layouts",
    "seed_table",
    "to_json",
    "vs_floor",
    "write_json",
]
