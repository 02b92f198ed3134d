"""flowlock's errors as HTTP answers: one mapping for the service and for your own views.

`problem(exc)` gives the status, an RFC 9457 `application/problem+json` body and the headers
for any exception. Retryable errors are 503 with `Retry-After`; a definition's fault is 500;
the rest are 4xx with the facts a client branches on. The body never carries connection
details or Python advice: the full error goes to the `flowlock.http` logger instead.
This module needs no web framework.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from flowlock.core.admin import InstancePaused, UnknownState
from flowlock.core.constraints import (
    CapacityReached,
    ConstraintRefused,
    RateLimited,
    UniqueViolation,
)
from flowlock.core.errors import (
    ConflictRetriesExhausted,
    ConnectionLost,
    CreateKeyReused,
    DefinitionError,
    DefinitionMismatch,
    EngineClosed,
    FlowlockError,
    GuardRejected,
    IdempotencyKeyReused,
    InstanceExists,
    InstanceNotFound,
    InvalidInput,
    LockBusy,
    LockError,
    LockLost,
    LockTimeout,
    LockUnavailable,
    MessageNotFound,
    OutcomeUnknown,
    PayloadTooLarge,
    StepFailed,
    StoreBusy,
    StoreError,
    TransitionNotAllowed,
    UnknownEvent,
    UnknownWorkflow,
    VersionMismatch,
)
from flowlock.core.migration import MigrationRefused
from flowlock.core.payloads import InvalidPayload

__all__ = [
    "PROBLEM_JSON",
    "RETRY_AFTER",
    "TYPE_PREFIX",
    "HttpProblem",
    "Problem",
    "etag",
    "from_error",
    "make_problem",
    "problem",
    "type_uri",
]

PROBLEM_JSON = "application/problem+json"
TYPE_PREFIX = "urn:flowlock:problem:"
RETRY_AFTER = 1
"""Seconds a 503 asks a client to wait: lock waits and pool waits are bounded well below it."""

log = logging.getLogger("flowlock.http")


def type_uri(slug: str) -> str:
    """The problem `type` of `slug`: `urn:flowlock:problem:<slug>`."""
    return TYPE_PREFIX + slug


class Problem(Exception):
    """An HTTP problem: raise it from a route, or build it from a flowlock error."""

    def __init__(
        self,
        status: int,
        slug: str,
        title: str,
        detail: str,
        members: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status} {slug}: {detail}")
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.members = dict(members or {})
        self.headers = dict(headers or {})

    def body(self, instance: str | None = None) -> dict[str, Any]:
        """The JSON body: `type`, `title`, `status`, `detail`, `instance` and the facts."""
        out: dict[str, Any] = {
            "type": type_uri(self.slug),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance is not None:
            out["instance"] = instance
        out.update(self.members)
        return out

    def encode(self, instance: str | None = None) -> bytes:
        """The body as JSON bytes."""
        # ASCII escapes: a member may echo a client's lone surrogate, which UTF-8 cannot encode.
        return json.dumps(self.body(instance), default=str).encode()


class HttpProblem(NamedTuple):
    """What `problem` answers: unpack it as `status, body, headers = problem(exc)`."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def problem(exc: BaseException, instance: str | None = None) -> HttpProblem:
    """The HTTP answer for `exc`, logged in full on the `flowlock.http` logger.

    `instance` is the request's path, echoed as the problem's `instance`. The headers hold
    `Content-Type: application/problem+json`, and `Retry-After` on a 503 (send the same
    request again, with the same Idempotency-Key). An exception that is not a
    flowlock error is a 500 that says only that the server failed.
    """
    found = from_error(exc) if isinstance(exc, FlowlockError) else _internal()
    where = instance or "a request"
    if found.status >= 500 and found.status != 503:
        # A fault of the server or of a definition: its traceback is what an operator needs.
        log.error("%s answered %d: %s", where, found.status, exc, exc_info=exc)
    elif found.status == 503:
        # Routine under contention or during a failover: one line, no traceback to flood with.
        log.warning("%s answered 503: %r", where, exc)
    else:
        log.debug("%s answered %d: %s", where, found.status, exc)
    headers = {"Content-Type": PROBLEM_JSON, **found.headers}
    return HttpProblem(found.status, found.body(instance), headers)


def _internal() -> Problem:
    return _make(500, "internal-error", "Internal error", "the server failed; nothing was applied")


def make_problem(
    status: int,
    slug: str,
    title: str,
    detail: str,
    headers: Mapping[str, str] | None = None,
    **members: Any,
) -> Problem:
    """A `Problem` of your own (a refusal of your route): the facts are keyword members."""
    return Problem(status, slug, title, detail, members, headers)


_make = make_problem


def _slug(exc: FlowlockError) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", type(exc).__name__).lower()


_RETRY = {"Retry-After": str(RETRY_AFTER)}


def from_error(exc: FlowlockError) -> Problem:  # noqa: C901 - one flat table, kept together
    """The problem `exc` is for an HTTP client: status, type, title, detail and facts.

    `problem` is the usual entry; this one keeps the `Problem` (the service raises it).
    """
    slug = _slug(exc)
    if isinstance(exc, InstanceNotFound):
        return _make(
            404, slug, "Instance not found",
            f"there is no instance {exc.instance_id!r}; create it first",
            instance_id=exc.instance_id,
        )  # fmt: skip
    if isinstance(exc, MessageNotFound):
        return _make(
            404, slug, "Message not found",
            f"there is no outbox message {exc.key!r}; list an instance's messages with GET "
            "/instances/{instance_id}/messages (a done message may have been deleted by the "
            "outbox's retention)",
            key=exc.key,
        )  # fmt: skip
    if isinstance(exc, UnknownEvent):
        return _make(
            404, slug, "Unknown event",
            f"workflow {exc.workflow!r} has no event {exc.event!r}; its events are "
            f"{', '.join(exc.known) or 'none'}",
            workflow=exc.workflow, event=exc.event, known=list(exc.known),
        )  # fmt: skip
    if isinstance(exc, UnknownWorkflow):
        return _make(
            422, slug, "Unknown workflow",
            f"this service has no workflow {exc.name!r}; it serves "
            f"{', '.join(exc.known) or 'none'}",
            workflow=exc.name, known=list(exc.known),
        )  # fmt: skip
    if isinstance(exc, InstanceExists):
        return _make(
            409, slug, "Instance already exists",
            f"an instance {exc.instance_id!r} already exists; pick another id, or read it",
            instance_id=exc.instance_id,
        )  # fmt: skip
    if isinstance(exc, TransitionNotAllowed):
        allowed = ", ".join(exc.allowed) or "none (a final state)"
        return _make(
            409, slug, "Transition not allowed",
            f"event {exc.event!r} is not allowed in state {exc.state!r}; allowed events: "
            f"{allowed}",
            instance_id=exc.instance_id, event=exc.event, state=exc.state,
            version=exc.version, allowed=list(exc.allowed),
        )  # fmt: skip
    if isinstance(exc, InstancePaused):
        what = "it" if exc.scope == "instance" else f"its workflow {exc.workflow!r}"
        return _make(
            409, slug, "Instance paused",
            f"instance {exc.instance_id!r} takes no events while {what} is paused by an "
            "operator; nothing was applied, send it again once it is resumed",
            instance_id=exc.instance_id, workflow=exc.workflow, scope=exc.scope,
            reason=exc.reason, version=exc.version,
        )  # fmt: skip
    if isinstance(exc, ConstraintRefused):
        return _constraint(exc, slug)
    if isinstance(exc, UnknownState):
        return _make(
            422, slug, "Unknown state",
            f"workflow {exc.workflow!r} has no state {exc.state!r}; its states are "
            f"{', '.join(exc.known)}",
            workflow=exc.workflow, state=exc.state, known=list(exc.known),
        )  # fmt: skip
    if isinstance(exc, MigrationRefused):
        return _make(
            422, slug, "Migration refused",
            f"migrating workflow {exc.workflow!r} to version {exc.to_version} would strand "
            "instances in states that version lacks; map each of them",
            workflow=exc.workflow, to_version=exc.to_version, stranded=dict(exc.stranded),
            known=list(exc.states),
        )  # fmt: skip
    if isinstance(exc, VersionMismatch):
        return _make(
            412, slug, "Version mismatch",
            f"If-Match asked for version {exc.expected} but instance {exc.instance_id!r} is at "
            f"version {exc.current} (state {exc.state!r}); read it again and decide",
            {"ETag": etag(exc.current)},
            instance_id=exc.instance_id, expected=exc.expected, current=exc.current,
            version=exc.current, state=exc.state,
        )  # fmt: skip
    if isinstance(exc, DefinitionMismatch):
        who = (
            "the create asked for"
            if exc.instance_id is None
            else f"instance {exc.instance_id!r} runs"
        )
        return _make(
            409, slug, "Definition version not served here",
            f"{who} version {exc.version} of workflow {exc.workflow!r}, which this service does "
            "not run (it runs "
            f"{list(exc.registered) or 'none'}); nothing was applied. Send it to a service that "
            "runs that version, or have an operator migrate the instance",
            instance_id=exc.instance_id, workflow=exc.workflow, version=exc.version,
            registered=list(exc.registered),
        )  # fmt: skip
    if isinstance(exc, GuardRejected):
        return _make(
            422, slug, "Refused by the workflow's rule",
            f"event {exc.event!r} was refused: {exc.reason}",
            instance_id=exc.instance_id, event=exc.event, state=exc.state,
            version=exc.version, reason=exc.reason,
        )  # fmt: skip
    if isinstance(exc, CreateKeyReused):
        return _make(
            422, "idempotency-key-reused", "Idempotency key reused",
            f"Idempotency-Key {exc.request_id!r} was first used to create instance "
            f"{exc.original_instance_id!r} with another {exc.mismatch.replace('_', ' ')}; a "
            "retry must repeat the request exactly, a new request needs a new key",
            instance_id=exc.instance_id, request_id=exc.request_id,
            original_instance_id=exc.original_instance_id, mismatch=exc.mismatch,
            original_workflow=exc.original_workflow, workflow=exc.workflow,
        )  # fmt: skip
    if isinstance(exc, IdempotencyKeyReused):
        return _make(
            422, slug, "Idempotency key reused",
            f"Idempotency-Key {exc.request_id!r} was first used for event "
            f"{exc.original_event!r} with another {exc.mismatch}; a retry must repeat the "
            "request exactly, a new request needs a new key",
            instance_id=exc.instance_id, request_id=exc.request_id,
            original_event=exc.original_event, event=exc.event, mismatch=exc.mismatch,
            version=exc.version,
        )  # fmt: skip
    if isinstance(exc, PayloadTooLarge):
        return _make(
            413, slug, "Payload too large",
            f"the {exc.what} is {exc.size} bytes as JSON; this service accepts at most "
            f"{exc.limit}",
            size=exc.size, limit=exc.limit,
        )  # fmt: skip
    if isinstance(exc, InvalidPayload):
        return _make(
            422, slug, "Invalid payload", str(exc),
            workflow=exc.workflow, event=exc.event, errors=[dict(e) for e in exc.errors],
        )  # fmt: skip
    if isinstance(exc, InvalidInput):
        return _make(422, slug, "Invalid input", str(exc))
    if isinstance(exc, OutcomeUnknown):
        return _make(
            503, slug, "Outcome unknown",
            "the database connection was lost while the write was being committed, so it may or "
            "may not have been applied; send the same request again with the same "
            "Idempotency-Key to learn which: it is never applied twice, and a retry answers "
            "what the first request did (a create retried with the same id and no key answers "
            "409 instance-exists if the first one was created)",
            _RETRY, instance_id=exc.key,
        )  # fmt: skip
    if isinstance(exc, ConflictRetriesExhausted):
        return _make(
            503, slug, "Too much contention",
            f"event {exc.event!r} lost the race for instance {exc.instance_id!r} "
            f"{exc.attempts} times; nothing was applied, retry later (or with strategy "
            "'pessimistic')",
            _RETRY, instance_id=exc.instance_id, event=exc.event, attempts=exc.attempts,
        )  # fmt: skip
    if isinstance(exc, LockTimeout | LockBusy):
        waited = exc.waited if isinstance(exc, LockTimeout) else 0.0
        return _make(
            503, slug, "Instance busy",
            f"another call held the lock on {exc.key!r} (waited {waited:.1f} s); nothing was "
            "applied, retry later",
            _RETRY, key=exc.key,
        )  # fmt: skip
    if isinstance(exc, LockLost):
        return _make(
            503, slug, "Lock lost",
            "the lease on the instance expired before the transition was written; nothing was "
            "applied, retry",
            _RETRY, key=exc.key,
        )  # fmt: skip
    if isinstance(exc, StoreBusy | LockUnavailable | ConnectionLost | LockError | EngineClosed):
        return _make(
            503, slug, "Service unavailable",
            "the service cannot reach its database or lock server right now, or is shutting "
            "down; nothing was applied, retry later",
            _RETRY,
        )  # fmt: skip
    if isinstance(exc, StoreError):
        return _make(
            503, slug, "Database unavailable",
            "the database refused the call; nothing was applied, retry later", _RETRY
        )  # fmt: skip
    if isinstance(exc, StepFailed):
        return _make(
            500, slug, "Workflow step failed",
            f"the workflow's {exc.step} for event {exc.event!r} raised an error; nothing was "
            "applied. This is a fault of the workflow definition, not of the request",
            instance_id=exc.instance_id, event=exc.event, state=exc.state, version=exc.version,
        )  # fmt: skip
    if isinstance(exc, DefinitionError):
        return _make(500, slug, "Workflow definition error", "a workflow definition is invalid")
    return _internal()


def _constraint(exc: ConstraintRefused, slug: str) -> Problem:
    """A rule across instances refused the call (409; a rate limit 429 with Retry-After)."""
    facts: dict[str, Any] = {
        "instance_id": exc.instance_id, "kind": exc.kind, "key": exc.key, "limit": exc.limit,
        "version": exc.version, "event": exc.event,
    }  # fmt: skip
    if isinstance(exc, RateLimited):
        wait = math.ceil(exc.retry_after)
        return _make(
            429, slug, "Rate limited",
            f"key {exc.key!r} of {exc.kind!r} reached its limit of {exc.limit} per "
            f"{exc.per:g} s; nothing was applied, send it again in {wait} s",
            {"Retry-After": str(wait)}, **facts, per=exc.per, retry_after=exc.retry_after,
        )  # fmt: skip
    if isinstance(exc, UniqueViolation):
        return _make(
            409, slug, "Key already held",
            f"instance {exc.holder!r} holds key {exc.key!r} of {exc.kind!r}; nothing was "
            "applied. Move or end that instance first",
            **facts, holder=exc.holder, holders=list(exc.holders),
        )  # fmt: skip
    holders = list(exc.holders) if isinstance(exc, CapacityReached) else []
    return _make(
        409, slug, "Capacity reached",
        f"all {exc.limit} slots of key {exc.key!r} of {exc.kind!r} are held; nothing was "
        "applied. Send it again once a holder leaves the state",
        **facts, holders=holders,
    )  # fmt: skip


def etag(version: int) -> str:
    """The ETag of an instance at `version` (a strong validator: the version is exact)."""
    return f'"{version}"'
