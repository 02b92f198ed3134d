"""The shapes of the service's JSON answers, for the OpenAPI document only.

The routes build plain dicts; these models only describe them, so they never change a
byte sent. No extra field is allowed: a field missing here fails the schemathesis check.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DefinitionList",
    "DefinitionOut",
    "Fired",
    "HistoryEntryOut",
    "HistoryPage",
    "InstanceOut",
    "InstancePage",
    "Live",
    "Ready",
    "TransitionOut",
]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InstanceOut(_Out):
    """An instance as it is now (its ETag is `"<version>"`)."""

    id: str
    workflow: str
    state: str
    version: int = Field(ge=1, description="1 at creation, +1 per applied transition.")
    data: dict[str, Any]
    last_event: str | None
    allowed: list[str] = Field(description="The events its state allows.")
    created_at: str | None = Field(json_schema_extra={"format": "date-time"})
    updated_at: str | None = Field(json_schema_extra={"format": "date-time"})


class InstancePage(_Out):
    items: list[InstanceOut]
    next_cursor: str | None = Field(description="Pass as cursor= for the next page; null: none.")


class Fired(_Out):
    """A fire's answer. A replay (same Idempotency-Key) gets the first answer again."""

    applied: bool = Field(description="This request's transition was applied (or, on a "
                          "replay, was applied by the first request with its key).")  # fmt: skip
    idempotent: bool = Field(description="Nothing to do: the instance was already there.")
    event: str
    request_id: str | None
    instance: InstanceOut


class HistoryEntryOut(_Out):
    instance_id: str
    version: int = Field(ge=2, description="The version this transition made.")
    event: str
    from_state: str
    to_state: str
    actor: str | None
    request_id: str | None
    strategy: str
    data: dict[str, Any]
    payload: dict[str, Any]
    at: str | None = Field(json_schema_extra={"format": "date-time"})
    fencing_token: int | None


class HistoryPage(_Out):
    items: list[HistoryEntryOut]
    next_cursor: int | None = Field(description="Pass as after= for the next page; null: none.")


class TransitionOut(_Out):
    event: str
    sources: list[str]
    targets: list[str]
    guarded: bool
    strategy: str | None


class DefinitionOut(_Out):
    name: str
    states: list[str]
    initial: str
    final: list[str]
    strategy: str | None
    transitions: list[TransitionOut]


class DefinitionList(_Out):
    items: list[DefinitionOut]


class Live(_Out):
    status: Literal["ok"]


class Ready(_Out):
    status: Literal["ok", "degraded"]
    checks: dict[str, str] = Field(description='Each backend: "ok" or what went wrong.')
