"""`GET /capacity/{kind}/{key}`: who holds the slots of one key of a constraint (a read)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from flowlock._capacity import capacity_of, known_kinds, usage_dict
from flowlock.engine import Engine
from flowlock.service.apidoc import ok
from flowlock.service.problems import problem
from flowlock.service.responses import CapacityOut

__all__ = ["capacity_routes"]


def capacity_routes(app: FastAPI, engine: Engine) -> None:
    # key:path: a key may hold a '/' (a client sends it as %2F, which arrives decoded).
    @app.get(
        "/capacity/{kind}/{key:path}",
        tags=["constraints"],
        summary="Who holds the slots of one key of a constraint, and its limit",
        response_model=None,
        responses=ok(CapacityOut, "The key's holders (oldest first), limit, used and free"),
    )
    async def capacity(kind: str, key: str) -> dict[str, Any]:
        usage = await capacity_of(engine, kind, key)
        if usage.rule is None and usage.limit is None and not usage.holders:
            known = await known_kinds(engine)
            raise problem(
                404, "constraint-not-found", "Constraint not found",
                f"no constraint of kind {kind!r} is served here or stored; the kinds known are "
                f"{', '.join(known) or 'none'}",
                kind=kind, key=key, known=known,
            )  # fmt: skip
        return usage_dict(usage)
