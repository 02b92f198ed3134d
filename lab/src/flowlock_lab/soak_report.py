"""The soak's report: a rich table and the `--json` document.

It only reads `flowlock_lab.soak_results`; nothing here runs anything.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from flowlock_lab.soak_results import FAULT_KINDS, OUTCOME_KINDS, SoakReport

__all__ = ["render_soak", "soak_table", "soak_to_json", "write_soak_json"]


def _verdict(ok: bool, failed: str = "FAILED") -> Text:
    return Text("ok", style="green") if ok else Text(failed, style="bold red")


def _counts(counts: dict[str, int] | Any, order: tuple[str, ...]) -> str:
    shown = [f"{kind} {counts[kind]:,}" for kind in order if counts.get(kind)]
    return ", ".join(shown) or "none"


def soak_table(report: SoakReport) -> Table:
    """The soak in one two-column table."""
    args = report.args
    redis = f", Redis {report.redis_version}" if report.redis_version else ""
    table = Table(
        title=(
            f"flowlock soak: {args.get('processes')} processes x {args.get('callers')} callers, "
            f"PostgreSQL {report.postgres_version}{redis}, {report.cores} cores, "
            f"seed {args.get('seed')}"
        ),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_header=False,
    )
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("figure")
    table.add_row("duration", f"{report.duration_s:.1f} s of load (asked {args.get('seconds')} s)")
    per_s = report.calls / report.duration_s if report.duration_s > 0 else 0.0
    table.add_row("calls", f"{report.calls:,} ({per_s:,.0f}/s) on {report.instances} instances")
    table.add_row("outcomes", _counts(dict(report.outcomes), OUTCOME_KINDS))
    errors = ", ".join(f"{name} {n:,}" for name, n in report.errors.items()) or "none"
    table.add_row("errors", errors)
    faults = _counts(report.faults_by_kind, FAULT_KINDS) if args.get("faults") else "off"
    if report.faults_failed:
        faults += f" ({report.faults_failed} could not be done)"
    table.add_row("faults", faults)
    table.add_row(
        "workers",
        f"{report.workers_started} started, {len(report.crashes)} crashed; at most "
        f"{report.peak_connections} database sessions",
    )
    table.add_row("leases lost", str(report.leases_lost))
    leaks = report.leaks
    table.add_row(
        "leaked",
        Text(
            f"{leaks.redis_lock_keys} Redis lock keys, {leaks.advisory_locks} advisory locks, "
            f"{leaks.connections} connections",
            style="" if leaks.total == 0 else "bold red",
        ),
    )
    table.add_row("escaped", _verdict(report.escaped == 0, f"{report.escaped} call(s)"))
    lin = report.linearizability
    table.add_row(
        "linearizable",
        Text.assemble(
            _verdict(report.linearizable),
            f"  {lin.get('calls', report.calls):,} calls, {lin.get('instances', 0)} instances",
        ),
    )
    table.add_row(
        "exactly once",
        Text.assemble(
            _verdict(report.exactly_once.ok),
            f"  {len(report.exactly_once.violations)} violation(s)",
        ),
    )
    table.add_row("verdict", _verdict(report.ok))
    return table


def render_soak(report: SoakReport, console: Console) -> None:
    """The table, then why it failed (if it did), the notes and what flowlock logged."""
    parts: list[Table | Text] = [soak_table(report)]
    parts.extend(Text(line, style="red") for line in report.problems())
    parts.extend(Text(f"note: {n}", style="yellow") for n in report.notes)
    if report.log:
        shown = [line if len(line) <= 200 else line[:197] + "..." for line in report.log[:10]]
        parts.append(Text("flowlock logged during the soak:\n  " + "\n  ".join(shown), style="dim"))
    console.print(Group(*parts))


def soak_to_json(report: SoakReport) -> dict[str, Any]:
    """The `--json` document of a soak (docs/benchmarks.md describes each key)."""
    return {
        "mode": "soak",
        "flowlock_version": report.flowlock_version,
        "postgres_version": report.postgres_version,
        "redis_version": report.redis_version,
        "cores": report.cores,
        "python": platform.python_version(),
        "args": dict(report.args),
        "duration_s": round(report.duration_s, 3),
        "calls": report.calls,
        "instances": report.instances,
        "outcomes": dict(report.outcomes),
        "errors": dict(report.errors),
        "error_samples": dict(report.error_samples),
        "faults": report.faults_by_kind,
        "faults_failed": report.faults_failed,
        "fault_log": [f.to_dict() for f in report.faults],
        "workers_started": report.workers_started,
        "peak_connections": report.peak_connections,
        "crashes": list(report.crashes),
        "leases_lost": report.leases_lost,
        "leaks": report.leaks.to_dict(),
        "escaped": report.escaped,
        "escapes": list(report.escapes),
        "linearizability": {"ok": report.linearizable, **dict(report.linearizability)},
        "exactly_once": report.exactly_once.to_dict(),
        "notes": list(report.notes),
        "log": list(report.log),
        "problems": report.problems(),
        "ok": report.ok,
    }


def write_soak_json(report: SoakReport, path: Path) -> None:
    """Write `soak_to_json` to `path` (UTF-8, indented, trailing newline)."""
    path.write_text(json.dumps(soak_to_json(report), indent=2) + "\n", encoding="utf-8")
