"""What the OpenAPI document says about answers, headers and bodies: the document only."""

from __future__ import annotations

from typing import Any

from flowlock._calls import MAX_ID_LENGTH
from flowlock.service.problems import PROBLEM_JSON

PROBLEM_DOC: dict[str, Any] = {
    PROBLEM_JSON: {
        "schema": {
            "type": "object",
            "properties": {
                "type": {"type": "string"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
                "instance": {"type": "string"},
            },
            "required": ["type", "title", "status", "detail"],
        }
    }
}


def header(description: str, *, required: bool = True, **schema: Any) -> dict[str, Any]:
    return {
        "description": description,
        "required": required,
        "schema": {"type": "string", **schema},
    }


ETAG = header('The instance\'s version, quoted ("3"): send it back as If-Match.')
CREATED_HEADERS = {
    "ETag": ETAG,
    "Location": header("The new instance's path (its id percent-encoded).", format="uri-reference"),
}
FIRED_HEADERS = {
    "ETag": ETAG,
    "Idempotent-Replayed": header(
        "true when this is a retry answered with the first response", required=False, enum=["true"]
    ),
    "Flowlock-Strategy": header("The strategy that ran this call."),
    "Flowlock-Attempts": header("Attempts this call took.", pattern="^[0-9]+$"),
    "Flowlock-Batch-Size": header("Calls committed together with this one.", pattern="^[0-9]+$"),
}

RATE_LIMITED: dict[int | str, dict[str, Any]] = {
    429: {
        "description": "rate-limited: the transition's rate limit is reached for its key; nothing "
        "was applied. The body names kind, key, limit, per and retry_after (seconds)",
        "content": PROBLEM_DOC,
        "headers": {
            "Retry-After": header(
                "Whole seconds until the key's window has room (retry_after, rounded up).",
                pattern="^[0-9]+$",
            )
        },
    }
}


# What _if_match and _idempotency_key accept, for the document only (each checks it itself and
# answers 400 with its own problem): so that generated clients and tests send valid ones.
IF_MATCH_DOC: dict[str, Any] = {
    "description": 'The ETag of the version the decision was made on ("3"), or *.',
    "pattern": '^ *(\\*|(W/)?"[1-9][0-9]{0,17}"|[1-9][0-9]{0,17}) *$',
}
KEY_DOC: dict[str, Any] = {
    "description": "The request's id: a retry with the same key gets the first answer again.",
    "minLength": 1,
    "maxLength": MAX_ID_LENGTH,
    "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]+$",
}

CREATE_KEY_DOC: dict[str, Any] = {
    **KEY_DOC,
    "description": (
        "The create's id: a retry with the same key and body gets the first answer again (the "
        "instance as created, 201) and creates nothing, also while the first is still running; "
        "the same key with another body is 422 idempotency-key-reused. Without an id in the "
        "body, the instance's id is derived from the key, so a retry names the same instance."
    ),
}


def ok(
    model: type[Any],
    description: str,
    status: int = 200,
    headers: dict[str, dict[str, Any]] | None = None,
) -> dict[int | str, dict[str, Any]]:
    """The documented success answer of a route: its body's model and headers.

    Declared with `responses=` and `response_model=None`, so it documents the body and
    never checks it.
    """
    doc: dict[str, Any] = {"model": model, "description": description}
    if headers:
        doc["headers"] = headers
    return {status: doc}


def body_doc(model: type[Any], *, required: bool) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


BEARER = "bearer"
"""The name of the bearer token's security scheme in the document."""
_BEARER_DOC = {
    "type": "http",
    "scheme": "bearer",
    "description": (
        "A token of FLOWLOCK_API_TOKEN (name:secret:scope). When the service has tokens, "
        "every operation but /livez and /readyz needs one whose scope covers it: read < "
        "write < admin. Each operation names the scope it needs (its security requirement "
        "and x-flowlock-scope). Without tokens the service needs none, binds to loopback "
        "only, and answers only requests whose Host is a loopback name or address (403 "
        "untrusted-host otherwise), unless started with --insecure."
    ),
}
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def _refusals() -> dict[str, dict[str, Any]]:
    return {
        "Unauthorized": {
            "description": "No valid bearer token (the service has tokens)",
            "content": PROBLEM_DOC,
        },
        "InsufficientScope": {
            "description": "The token's scope does not cover this operation",
            "content": PROBLEM_DOC,
        },
    }


def document_access(schema: dict[str, Any], *, open_metrics: bool) -> dict[str, Any]:
    """`schema` with the bearer scheme, and each operation's needed scope as the guard sees it.

    The scopes come from `needed_scope`, the guard's own rule, so a route added later is
    documented as it is guarded. An operation that needs no token gets `security: []`.
    """
    from flowlock.service.guard import needed_scope

    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})[BEARER] = _BEARER_DOC
    components.setdefault("responses", {}).update(_refusals())
    for path, item in schema.get("paths", {}).items():
        for method in _METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            needed = needed_scope(method, path, open_metrics=open_metrics)
            if needed is None:
                operation["security"] = []
                continue
            operation["security"] = [{BEARER: [needed]}]
            operation["x-flowlock-scope"] = needed
            responses = operation.setdefault("responses", {})
            responses.setdefault("401", {"$ref": "#/components/responses/Unauthorized"})
            responses.setdefault("403", {"$ref": "#/components/responses/InsufficientScope"})
    return schema
