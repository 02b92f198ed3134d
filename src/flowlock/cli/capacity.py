"""`flowlock capacity KIND KEY`: who holds the slots of one key of a constraint (read-only)."""

from __future__ import annotations

from typing import Annotated

import typer

from flowlock._capacity import capacity_of, known_kinds, usage_dict
from flowlock.cli._common import app, fail, stdout
from flowlock.cli._table import Column, print_record
from flowlock.cli.inspect import AsJson, InspectDatabaseUrl, InspectSchema, _cell, _inspect, _json
from flowlock.core.constraints import CapacityUsage
from flowlock.engine import Engine

__all__ = ["capacity"]


@app.command("capacity")
def capacity(
    kind: Annotated[
        str,
        typer.Argument(
            metavar="KIND",
            help="The constraint's name: WORKFLOW.STATE (a capacity), WORKFLOW.unique, "
            "WORKFLOW.TRANSITION.rate, or the kind= it was given.",
            show_default=False,
        ),
    ],
    key: Annotated[
        str, typer.Argument(metavar="KEY", help="The key counted under.", show_default=False)
    ],
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Print who holds the slots of one key of a constraint: its rule, limit, how many are used
    and free, and the holding instances, oldest first. For a rate limit, the instances whose
    transitions count in the current window.

    The rule and limit are read from the stored definitions. Exits 1 when no stored
    definition or row knows KIND. Read-only."""

    async def read(engine: Engine) -> tuple[CapacityUsage, list[str] | None]:
        usage = await capacity_of(engine, kind, key)
        if usage.rule is None and usage.limit is None and not usage.holders:
            return usage, await known_kinds(engine)
        return usage, None

    usage, unknown = _inspect(database_url, schema, read)
    if unknown is not None:
        fail(
            f"no constraint of kind {kind!r} is stored in this database; the kinds known are "
            f"{', '.join(unknown) or 'none'}"
        )
    if as_json:
        _json(usage_dict(usage))
        return
    fields = [
        ("kind", usage.kind),
        ("key", usage.key),
        ("rule", usage.rule),
        ("limit", usage.limit),
        ("used", usage.used),
        ("free", usage.free),
    ]
    if usage.window is not None:
        fields.append(("window", f"{usage.window:g} s"))
    out = stdout()
    print_record(
        out,
        [(Column(name), _cell(value)) for name, value in fields]
        + [(Column("holders", text=True), _cell(", ".join(usage.holders) or None))],
    )
