"""The `--json` document of `flowlock bench --json FILE`.

Its keys keep the names and units docs/benchmarks.md documents. Extra keys follow them.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowlock.bench.outbox_results import outbox_pairs, section_to_json
from flowlock.bench.report.aims import (
    FLOOR,
    FLOOR_METHOD,
    aims,
    floors,
    in_process,
    overhead,
    vs_floor,
)
from flowlock.bench.report.timers_table import races
from flowlock.bench.results import HTTP, BenchReport, ScenarioResult
from flowlock.bench.timer_results import IDLE_TARGET, LAG_P99_TARGET_MS, RACE_TARGET

__all__ = ["outbox_to_json", "result_to_json", "timers_to_json", "to_json", "write_json"]


def _ms(value: float) -> float:
    return round(value, 3)


def _rounded(ratios: Mapping[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 3) for k, v in ratios.items()}


def _unsampled(result: ScenarioResult, value: float) -> float | None:
    # The service's connections are not the run's: over HTTP nothing sampled them.
    return None if result.transport == HTTP else value


def result_to_json(
    result: ScenarioResult,
    floor: ScenarioResult | None = None,
    twin: ScenarioResult | None = None,
) -> dict[str, Any]:
    """One result in the documented shape, then the extra fields.

    `twin` is the in-process result of the same pair, for `vs_in_process`.
    The sampler's figures are null for an HTTP result: they are not measured.
    """
    found = overhead(result, twin)
    return {
        "scenario": result.scenario,
        "strategy": result.strategy,
        "workers": result.workers,
        "calls": result.calls,
        "avg_ms": _ms(result.avg_ms),
        "p50_ms": _ms(result.p50_ms),
        "p99_ms": _ms(result.p99_ms),
        "max_ms": _ms(result.max_ms),
        "success_pct": round(result.success_pct, 3),
        "attempts_per_call": round(result.attempts_per_call, 4),
        "calls_per_s": round(result.calls_per_s, 1),
        "applied_per_s": round(result.applied_per_s, 1),
        "peak_connections": _unsampled(result, result.peak_connections),
        "verdict": result.verdict.to_dict(),
        # extras
        "lock_wait_ms": _unsampled(result, _ms(result.lock_wait_ms)),
        "row_lock_wait_s": _unsampled(result, round(result.row_lock_wait_s, 4)),
        "lease_wait_s": _unsampled(result, round(result.lease_wait_s, 4)),
        "rounds": result.rounds,
        "ops": result.ops,
        "processes": result.processes,
        "loop": result.loop,
        "double_advanced_rounds": result.double_advanced_rounds,
        "errors": dict(result.errors),
        "applied": result.applied,
        "idempotent": result.idempotent,
        "refused": result.refused,
        "failed": result.failed,
        "applied_per_round": list(result.applied_per_round),
        "peak_active_connections": _unsampled(result, result.peak_active_connections),
        "open_connections": _unsampled(result, result.open_connections),
        "wall_s": round(result.wall_s, 4),
        "floor": result.floor,
        "vs_floor": _rounded(vs_floor(result, floor)),
        "mean_batch": None if result.mean_batch is None else round(result.mean_batch, 3),
        "hosts": result.hosts,
        "escalations": (
            None
            if result.escalated is None or result.adopted is None
            else {"escalated": result.escalated, "adopted": result.adopted}
        ),
        "transport": result.transport,
        "vs_in_process": None if found is None else found.to_json(),
        "cpu_us": None if result.cpu_us is None else round(result.cpu_us, 1),
        **({} if result.capacity is None else result.capacity.to_json()),
    }


def timers_to_json(report: BenchReport) -> dict[str, Any] | None:
    """The timers section: the `deadline` races, the firing lag and the idle cost.

    None when the run had no `deadline`.
    """
    raced = races(report)
    section = report.timers
    if not raced and section is None:
        return None
    idle = None if section is None or section.idle is None else section.idle.to_json()
    return {
        "race": [race.to_json(strategy) for strategy, race in raced],
        "lag": [] if section is None else [f.to_json() for f in section.lag],
        "idle": idle,
        "notes": [] if section is None else list(section.notes),
        "targets": {
            "race_resolved_per_s": RACE_TARGET,
            "lag_p99_ms": LAG_P99_TARGET_MS,
            "idle_timer_statements_per_s": IDLE_TARGET,
        },
    }


def outbox_to_json(report: BenchReport) -> dict[str, Any] | None:
    """The outbox section: each pair beside its twin without messages, and the idle cost.

    None when the run had no outbox pair.
    """
    pairs = outbox_pairs(report)
    if not pairs and report.outbox is None:
        return None
    return section_to_json(pairs, report.outbox)


def to_json(report: BenchReport) -> dict[str, Any]:
    """The whole report as the JSON document `flowlock bench --json` writes."""
    base = floors(report)
    twins = in_process(report)
    return {
        "flowlock_version": report.flowlock_version,
        "postgres_version": report.postgres_version,
        "redis_version": report.redis_version,
        "cores": report.cores,
        "args": dict(report.args),
        "results": [
            result_to_json(
                r,
                base.get(r.scenario) if r.transport != HTTP else None,
                twins.get((r.scenario, r.strategy)),
            )
            for r in report.results
        ],
        # extras
        "loop": report.loop,
        "database": report.database,
        "redis": report.redis,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "duration_s": round(report.duration_s, 3),
        "floors": {
            s: {
                "strategy": FLOOR,
                "method": r.floor,
                "description": FLOOR_METHOD.get(r.floor or ""),
            }
            for s, r in base.items()
        },
        "aims": [a.to_dict() for a in aims(report)],
        "skipped": list(report.skipped),
        "log": list(report.log),
        "notes": list(report.notes),
        "timers": timers_to_json(report),
        "outbox": outbox_to_json(report),
        "ok": report.ok,
    }


def write_json(report: BenchReport, path: Path) -> None:
    """Write `to_json` to `path` (UTF-8, indented, trailing newline)."""
    path.write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")
