"""`flowlock definitions`: the stored versions of each workflow's definition (read-only)."""

from __future__ import annotations

from typing import Annotated

import typer

from flowlock.cli._common import app, stdout
from flowlock.cli._table import Column, print_rows
from flowlock.cli.inspect import AsJson, InspectDatabaseUrl, InspectSchema, _cell, _inspect, _json
from flowlock.core.versions import DefinitionVersion
from flowlock.engine import Engine

__all__ = ["definitions"]

_COLUMNS = [Column(name) for name in ("workflow", "version", "hash", "created", "instances")]
HASH_SHOWN = 12
"""How many hex digits of a definition's hash the table shows (--json shows it whole)."""


def version_dict(v: DefinitionVersion) -> dict[str, object]:
    """One stored version as JSON-ready values (its canonical definition included)."""
    return {
        "workflow": v.workflow,
        "version": v.version,
        "hash": v.hash,
        "created_at": None if v.created_at is None else v.created_at.isoformat(),
        "instances": v.instances,
        "definition": dict(v.definition),
    }


@app.command("definitions")
def definitions(
    workflow: Annotated[
        str | None,
        typer.Argument(
            metavar="[WORKFLOW]", help="Only this workflow's versions.", show_default=False
        ),
    ] = None,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """List the stored versions of each workflow's definition: workflow, version, the start of
    its content hash, when it was first registered, and how many instances run it.

    A version is stored by the first register() of a changed definition; instances keep the
    version they were created with until migrated. --json adds each version's whole hash and
    canonical definition. Read-only."""

    async def read(engine: Engine) -> list[DefinitionVersion]:
        return await engine.definitions(workflow)

    found = _inspect(database_url, schema, read)
    if as_json:
        _json([version_dict(v) for v in found])
        return
    shown = f"of {workflow} " if workflow else ""
    print_rows(
        stdout(),
        f"definitions {shown}({len(found)} version(s))",
        _COLUMNS,
        [
            [
                _cell(v.workflow),
                _cell(v.version),
                _cell(v.hash[:HASH_SHOWN]),
                _cell(None if v.created_at is None else v.created_at.isoformat(sep=" ")[:19]),
                _cell(v.instances),
            ]
            for v in found
        ],
    )
