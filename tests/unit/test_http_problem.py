"""`flowlock.http.problem`: every error's HTTP answer, safe for clients, logged in full."""

from __future__ import annotations

import logging

import pytest

from flowlock import errors
from flowlock.http import PROBLEM_JSON, HttpProblem, problem

SECRET = "host=db.internal port=6543 dbname=payroll"

CASES: list[tuple[BaseException, int, str]] = [
    (errors.InstanceNotFound("a-1"), 404, "instance-not-found"),
    (errors.UnknownEvent("approval", "zap", ["approve"]), 404, "unknown-event"),
    (errors.UnknownWorkflow("nope", ["approval"]), 422, "unknown-workflow"),
    (errors.InstanceExists("a-1"), 409, "instance-exists"),
    (errors.TransitionNotAllowed("a-1", "approve", "done", ("reopen",), 3), 409,
     "transition-not-allowed"),
    (errors.GuardRejected("over budget", instance_id="a-1", event="approve", state="pending",
                          version=2), 422, "guard-rejected"),
    (errors.VersionMismatch("a-1", 2, 3, "pending"), 412, "version-mismatch"),
    (errors.PayloadTooLarge(2_000_000, 1_000_000), 413, "payload-too-large"),
    (errors.IdempotencyKeyReused("k", instance_id="a-1", original_event="approve",
                                 event="reject", original_payload={}, payload={}, version=2),
     422, "idempotency-key-reused"),
    (errors.CreateKeyReused("k", original_instance_id="a-1", instance_id="a-2",
                            original_workflow="approval", workflow="approval",
                            original_data={}, data={}), 422, "idempotency-key-reused"),
    (errors.InvalidInput("actor must not be empty"), 422, "invalid-input"),
    (errors.ConflictRetriesExhausted("a-1", "approve", 5), 503, "conflict-retries-exhausted"),
    (errors.LockTimeout("a-1", 2.0), 503, "lock-timeout"),
    (errors.LockBusy("a-1"), 503, "lock-busy"),
    (errors.LockLost("a-1", "the lease expired"), 503, "lock-lost"),
    (errors.LockUnavailable("redis", SECRET), 503, "lock-unavailable"),
    (errors.StoreBusy(1.5, 20), 503, "store-busy"),
    (errors.ConnectionLost("a-1", SECRET), 503, "connection-lost"),
    (errors.OutcomeUnknown("a-1", SECRET), 503, "outcome-unknown"),
    (errors.EngineClosed("the engine is closed; call Engine.connect() again"), 503,
     "engine-closed"),
    (errors.MigrationError(SECRET), 503, "migration-error"),
    (errors.StepFailed(workflow="approval", event="approve", instance_id="a-1", step="action",
                       state="pending", version=2, error=ValueError(SECRET)), 500,
     "step-failed"),
    (errors.DefinitionError(f"bad definition {SECRET}"), 500, "definition-error"),
    (RuntimeError(SECRET), 500, "internal-error"),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "status", "slug"), CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_each_error_has_its_status_type_and_headers(
    exc: BaseException, status: int, slug: str
) -> None:
    """Each error maps to the service's status and type; a 503 says when to retry."""
    found = problem(exc, "/instances/a-1/events/approve")
    assert isinstance(found, HttpProblem)
    code, body, headers = found
    assert code == status == body["status"]
    assert body["type"] == f"urn:flowlock:problem:{slug}"
    assert body["instance"] == "/instances/a-1/events/approve"
    assert body["title"] and body["detail"]
    assert headers["Content-Type"] == PROBLEM_JSON
    assert ("Retry-After" in headers) == (status == 503)
    if status == 503:
        assert int(headers["Retry-After"]) >= 1


@pytest.mark.parametrize(("exc", "status", "slug"), CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_bodies_carry_no_server_details(exc: BaseException, status: int, slug: str) -> None:
    """Connection details, a step's exception and Python advice stay out of the body."""
    _, body, _ = problem(exc)
    text = repr(body)
    assert SECRET not in text and "db.internal" not in text
    assert "Engine.connect" not in text and "Traceback" not in text


def test_the_full_error_goes_to_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """A 500 is logged on `flowlock.http` at ERROR with its traceback; a 503, routine under
    contention, as one WARNING line that still holds the error's whole text."""
    try:
        raise RuntimeError(SECRET)
    except RuntimeError as exc:
        with caplog.at_level(logging.DEBUG, logger="flowlock.http"):
            problem(exc, "/instances/a-1/events/approve")
            problem(errors.ConnectionLost("a-1", SECRET))
    crash, lost = [r for r in caplog.records if r.name == "flowlock.http"]
    assert crash.levelno == logging.ERROR and crash.exc_info is not None
    assert lost.levelno == logging.WARNING and lost.exc_info is None
    assert SECRET in crash.getMessage() and SECRET in lost.getMessage()


def test_a_client_error_is_logged_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """A 4xx is the client's doing: logged at DEBUG, not as a server error."""
    with caplog.at_level(logging.DEBUG, logger="flowlock.http"):
        problem(errors.InstanceNotFound("a-1"))
    assert [r.levelno for r in caplog.records if r.name == "flowlock.http"] == [logging.DEBUG]


def test_facts_are_members() -> None:
    """The facts a client branches on are members of the body, as the service sends them."""
    _, body, _ = problem(errors.TransitionNotAllowed("a-1", "approve", "done", ("reopen",), 3))
    assert body["state"] == "done" and body["version"] == 3 and body["allowed"] == ["reopen"]
    _, body, headers = problem(errors.VersionMismatch("a-1", 2, 3, "pending"))
    assert body["current"] == 3 and headers["ETag"] == '"3"'


def test_a_reused_create_key_names_the_first_create() -> None:
    """A create's key sent with another create: the same type as an event's, with the first
    create's instance and what differs."""
    exc = errors.CreateKeyReused("k", original_instance_id="a-1", instance_id="a-1",
                                 original_workflow="approval", workflow="approval",
                                 original_data={"n": 1}, data={"n": 2})  # fmt: skip
    assert isinstance(exc, errors.IdempotencyKeyReused) and exc.mismatch == "data"
    _, body, _ = problem(exc)
    facts = (body["request_id"], body["original_instance_id"], body["mismatch"])
    assert facts == ("k", "a-1", "data")
