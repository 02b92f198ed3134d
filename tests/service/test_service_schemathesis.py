"""schemathesis against the committed OpenAPI document (docs/openapi.json, held equal to the live
one by test_service_openapi.py), in-process on the memory store: generated requests, valid and
invalid, to every operation. None may get a 5xx, and every answer must be one the document
describes (status, content type, body schema, required headers).

Generated names rarely hit anything that exists, so part of the generated requests are steered
to instances, events and workflows that do (chosen from the generated value itself, so a failure
still shrinks and replays): those fire real transitions with generated bodies and headers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.python.asgi import get_client, shutdown_lifespans

from flowlock.service import create_app

DOCUMENT = Path(__file__).parents[2] / "docs" / "openapi.json"

APP = create_app()
SCHEMA = schemathesis.openapi.from_path(DOCUMENT)
SCHEMA.app = APP

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]

# The app has no token, so it answers only requests addressed to a loopback host (the guard's
# DNS-rebinding rule): every request goes to 127.0.0.1, not to the client's "testserver".
BASE_URL = "http://127.0.0.1"
WORKFLOWS = ["approval", "countersign", "inventory"]
INSTANCES = [f"{wf}-{n}" for wf in WORKFLOWS for n in (1, 2)]
EVENTS = ["approve", "reject", "sign", "reserve", "restock"]


@pytest.fixture(scope="module", autouse=True)
def running_app() -> Iterator[None]:
    """The app's lifespan (the engine), opened once with two instances of each workflow, and
    closed after the module (schemathesis keeps it open between its calls)."""
    # FastAPI types its ASGI arguments as MutableMappings, schemathesis as dicts: the same app.
    with get_client(cast(Any, APP)) as client:
        client.base_url = BASE_URL
        for iid in INSTANCES:
            workflow = iid.rsplit("-", 1)[0]
            body: dict[str, Any] = {"workflow": workflow, "id": iid, "data": {"stock": 10_000}}
            assert client.post("/instances", json=body).status_code == 201
    yield
    shutdown_lifespans()


def pick(value: Any, known: Sequence[str]) -> Any:
    """One of ``known``, or ``value`` itself, chosen by the generated value's length."""
    if not isinstance(value, str):
        return value
    slot = len(value) % (len(known) + 1)
    return known[slot] if slot < len(known) else value


def steer(case: schemathesis.Case[Any]) -> None:
    """Point part of the generated requests at what exists; keep the rest as generated."""
    params = case.path_parameters
    if params:
        for name, known in (("instance_id", INSTANCES), ("event", EVENTS), ("workflow", WORKFLOWS)):
            if name in params:
                params[name] = pick(params[name], known)
    if case.headers and "if-match" in {h.lower() for h in case.headers}:
        name = next(h for h in case.headers if h.lower() == "if-match")
        case.headers[name] = pick(case.headers[name], ["*"])
    if case.path == "/instances" and case.method == "POST" and isinstance(case.body, dict):
        case.body["workflow"] = pick(case.body.get("workflow"), WORKFLOWS)


@SCHEMA.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_every_answer_documented(case: schemathesis.Case[Any]) -> None:
    """Generated requests to the operation: no 5xx, and each answer as documented."""
    steer(case)
    case.call_and_validate(checks=CHECKS, base_url=BASE_URL)
