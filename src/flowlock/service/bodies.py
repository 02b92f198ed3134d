"""Request bodies: read as bytes, checked as JSON by hand, then validated by the models.

Python's JSON parser accepts NaN and recurses once per nesting level. So content type,
UTF-8 JSON, constants, depth and object shape are checked first, each refused as a
problem. The models then say which field is wrong (422).
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from flowlock.service.problems import Problem, problem

__all__ = ["CreateBody", "FireBody", "parse_json", "read_json"]

_M = TypeVar("_M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CreateBody(_Body):
    """Create an instance of `workflow` in its initial state at version 1."""

    workflow: str = Field(description="The workflow's name (GET /definitions).")
    id: str | None = Field(
        default=None,
        validation_alias=AliasChoices("id", "instance_id"),
        description="The new instance's id (also accepted as instance_id); omitted: a random UUID.",
    )
    data: dict[str, Any] = Field(default_factory=dict, description="The instance's data.")
    version: int | None = Field(
        default=None,
        ge=1,
        description="The definition version the instance runs (GET /definitions); omitted: the "
        "newest the service registered. A version it has not registered is 409 "
        "definition-mismatch.",
    )


class FireBody(_Body):
    """Fire an event. Every field is optional; an empty body is an empty object."""

    actor: str | None = Field(
        default=None,
        description="Who fires (recorded in history). With bearer tokens configured, the "
        "token's principal is the actor and this field is ignored.",
    )
    payload: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the guard and effect; kept in history."
    )
    strategy: str | None = Field(
        default=None,
        description="optimistic, pessimistic, distributed or adaptive; omitted: the "
        "workflow's or the service's default.",
    )


_JSON_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def _bad(status: int, slug: str, title: str, detail: str) -> NoReturn:
    raise problem(status, slug, title, detail)


def _not_json(text: str) -> NoReturn:
    _bad(400, "invalid-json", "Body is not valid JSON", text)


def _constant(name: str) -> NoReturn:
    _not_json(f"{name} is not a JSON value; send numbers as finite numbers")


def _finite(text: str) -> float:
    # 1e999 parses to infinity: as far outside JSON's numbers as NaN is.
    value = float(text)
    if not math.isfinite(value):
        _not_json(f"{text} is too large for a JSON number")
    return value


def _depth(value: object, limit: int) -> None:
    """Refuse `value` when containers nest deeper than `limit` (walked without recursion)."""
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if not isinstance(item, list):
            continue
        if level > limit:
            _too_deep(limit)
        todo.extend((child, level + 1) for child in item)


def _too_deep(limit: int) -> NoReturn:
    _bad(
        400, "json-too-deep", "JSON nested too deeply",
        f"the body nests objects and arrays more than {limit} levels deep",
    )  # fmt: skip


async def read_json(request: Request, model: type[_M], max_depth: int, *, empty_ok: bool) -> _M:
    """The request's body as `model`, or a Problem saying what is wrong with it."""
    raw = await request.body()
    content_type = request.headers.get("content-type", "")
    return parse_json(raw, content_type, model, max_depth, empty_ok=empty_ok)


def parse_json(
    raw: bytes, content_type: str, model: type[_M], max_depth: int, *, empty_ok: bool
) -> _M:
    """`raw` (sent as `content_type`) as `model`, or a Problem saying what is wrong with it.

    The FastAPI routes and the fast layer both read bodies through it."""
    if not raw.strip():
        if empty_ok:
            return model()
        _bad(422, "invalid-body", "Request body required", "send a JSON object as the body")
    media = content_type.split(";")[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        _bad(
            415, "unsupported-media-type", "Unsupported content type",
            f"the body must be JSON sent as Content-Type: application/json, not {media or 'none'}",
        )  # fmt: skip
    try:
        value = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except Problem:
        raise
    except RecursionError:
        _too_deep(max_depth)
    except UnicodeDecodeError:
        _not_json("the body is not UTF-8 text")
    except ValueError as exc:
        _not_json(f"the body is not valid JSON: {exc}")
    if not isinstance(value, dict):
        _bad(
            422, "invalid-body", "Body must be a JSON object",
            f"the body is a JSON {_JSON_NAMES.get(type(value), 'value')}; send an object",
        )  # fmt: skip
    _depth(value, max_depth)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise invalid_fields(exc.errors(include_url=False, include_context=False)) from None


def invalid_fields(errors: list[Any]) -> Problem:
    """A 422 listing each field that failed validation (`errors`: where and why)."""
    shown = [
        {"where": ".".join(str(p) for p in e.get("loc", ())), "message": str(e.get("msg", ""))}
        for e in errors
    ]
    text = "; ".join(f"{e['where'] or 'body'}: {e['message']}" for e in shown[:5])
    return problem(422, "invalid-request", "Invalid request", text, errors=shown)
