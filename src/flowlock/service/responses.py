"""The shapes of the service's JSON answers, for the OpenAPI document only.

The routes build plain dicts; these models only describe them, so they never change a
byte sent. No extra field is allowed: a field missing here fails the schemathesis check.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CapacityOut",
    "DefinitionList",
    "DefinitionOut",
    "Fired",
    "HistoryEntryOut",
    "HistoryPage",
    "InstanceOut",
    "InstancePage",
    "Live",
    "MessageList",
    "MessageOut",
    "NextTimerOut",
    "Ready",
    "StoredVersionOut",
    "TimerList",
    "TimerOut",
    "TransitionOut",
]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NextTimerOut(_Out):
    """The instance's earliest armed timer."""

    event: str = Field(description="The timed transition that fires.")
    due_at: str = Field(
        description="When it is due, on the database's clock.",
        json_schema_extra={"format": "date-time"},
    )
    stay: int = Field(
        ge=1, description="The version at which the instance entered the state that armed it."
    )


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
    paused: bool = Field(description="An operator paused it (POST /admin/instances/{id}/pause).")
    workflow_paused: bool = Field(
        description="Its whole workflow is paused (POST /admin/workflows/{name}/pause). Either "
        "way events are refused (409 instance-paused); a forced state is not."
    )
    definition_version: int | None = Field(
        description="The version of its workflow's definition it runs (GET /definitions); null: "
        "created before versions, it runs the newest the service has."
    )
    next_timer: NextTimerOut | None = Field(
        default=None,
        description="Its next due timer, null when none is armed (GET "
        "/instances/{instance_id}/timers lists them all). Sent by every answer about one "
        "instance (create, fire, GET), read when answering; a replay shows the timer of the "
        "stay it answers with, null once that stay has ended. The instances of a list leave it "
        "out (reading it would cost a query per instance), and so does a create or fire whose "
        "read of the timers failed after the call succeeded.",
    )


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
    kind: str = Field(
        description="transition (a fired event), an operator's forced, pause or resume row "
        "(event flowlock:force, flowlock:pause, flowlock:resume; its payload holds the reason), "
        "or a migrated row (event flowlock:migrate: the instance moved to the definition "
        "version its payload names)."
    )
    definition_version: int | None = Field(
        description="The definition version the row was decided with; null: unknown (older)."
    )


class HistoryPage(_Out):
    items: list[HistoryEntryOut]
    next_cursor: int | None = Field(description="Pass as after= for the next page; null: none.")


class TimerOut(_Out):
    """One armed timer: its transition fires once the instance has stayed `after` in the
    state (reminders: every `every` seconds, at most `limit` firings)."""

    instance_id: str
    workflow: str
    event: str
    stay: int = Field(
        ge=1, description="The version at which the instance entered the state that armed it."
    )
    n: int = Field(ge=0, description="Firings done so far (a reminder counts up).")
    due_at: str = Field(
        description="When it is due, on the database's clock.",
        json_schema_extra={"format": "date-time"},
    )
    lag: float = Field(ge=0, description="Seconds past due when read (0: not due yet).")
    every: float | None = Field(description="A reminder's period in seconds; null: fires once.")
    limit: int | None = Field(description="A reminder's most firings; null: no limit.")
    claimed_until: str | None = Field(
        description="While an engine fires it: when its claim runs out.",
        json_schema_extra={"format": "date-time"},
    )


class TimerList(_Out):
    items: list[TimerOut] = Field(description="The instance's armed timers, earliest due first.")


class MessageOut(_Out):
    """One outbox message: what a transition emitted, and where its delivery is."""

    key: str = Field(
        description="<instance_id>:<version>:<n>: the idempotency key its handler passes on; "
        "the same on every redelivery."
    )
    instance_id: str
    workflow: str
    version: int = Field(ge=2, description="The version the emitting transition made.")
    n: int = Field(ge=0, description="Its place among that transition's messages, from 0.")
    kind: str = Field(description="Which handler delivers it.")
    status: Literal["pending", "running", "done", "dead"] = Field(
        description="pending: waiting to be delivered (or tried again); running: an engine "
        "delivers it now; done: delivered; dead: given up after its handler's max_attempts "
        "(kept until retried or dropped)."
    )
    attempts: int = Field(ge=0, description="Deliveries begun so far.")
    last_error: str | None = Field(description="Why the last delivery failed; null: none did.")
    next_attempt_at: str | None = Field(
        description="While pending: when it may be delivered (again), on the database's clock.",
        json_schema_extra={"format": "date-time"},
    )
    created_at: str | None = Field(
        description="When the transition that emitted it committed.",
        json_schema_extra={"format": "date-time"},
    )
    done_at: str | None = Field(
        description="When it was delivered; null until done.",
        json_schema_extra={"format": "date-time"},
    )
    claimed_until: str | None = Field(
        description="While running: when its delivery's claim runs out (another engine may "
        "then take it over).",
        json_schema_extra={"format": "date-time"},
    )
    fencing_token: int | None = Field(
        description="The lease's fencing token when the distributed strategy wrote the "
        "transition; null otherwise."
    )
    payload: dict[str, Any]


class MessageList(_Out):
    items: list[MessageOut] = Field(
        description="The instance's messages in the order they were emitted (version, then n)."
    )


class TransitionOut(_Out):
    event: str
    sources: list[str]
    targets: list[str]
    guarded: bool
    strategy: str | None


class StoredVersionOut(_Out):
    """One stored version of a workflow's definition."""

    version: int = Field(ge=1)
    hash: str = Field(description="sha256 of the definition's canonical form.")
    created_at: str | None = Field(json_schema_extra={"format": "date-time"})
    instances: int | None = Field(description="Instances that run this version.")
    served: bool = Field(description="This service has this version's code registered.")


class DefinitionOut(_Out):
    name: str
    states: list[str]
    initial: str
    final: list[str]
    strategy: str | None
    transitions: list[TransitionOut]
    version: int | None = Field(
        default=None,
        description="The newest version this service runs: what a create pins (null: none stored).",
    )
    versions: list[StoredVersionOut] = Field(
        default_factory=list,
        description="Every stored version of the workflow (GET /definitions only), oldest first.",
    )


class DefinitionList(_Out):
    items: list[DefinitionOut]


class Live(_Out):
    status: Literal["ok"]


class Ready(_Out):
    status: Literal["ok", "degraded"]
    checks: dict[str, str] = Field(description='Each backend: "ok" or what went wrong.')


class CapacityOut(_Out):
    """Who holds the slots of one key of a constraint, and its limit."""

    kind: str = Field(
        description="The constraint's name: <workflow>.<state> (a capacity), <workflow>.unique, "
        "<workflow>.<transition>.rate, or the kind= it was given."
    )
    key: str
    limit: int | None = Field(
        description="The rule's limit (null: no rule served here or stored row knows the kind)."
    )
    holders: list[str] = Field(
        description="The instances holding a slot, oldest first; for a rate limit, the "
        "instances of the applications counted in the current window."
    )
    used: int = Field(ge=0, description="How many hold one (len(holders)).")
    free: int | None = Field(description="Slots left (null when the limit is unknown).")
    rule: Literal["capacity", "unique", "rate"] | None
    window: float | None = Field(
        default=None, description="A rate limit's window in seconds; null for slots."
    )
