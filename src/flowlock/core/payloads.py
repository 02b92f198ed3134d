"""Typed payloads: a transition's payload and a workflow's data, checked against a schema.

A schema is a Pydantic v2 model class or a JSON Schema dict. The model is duck-typed (it has
`model_validate` and `model_json_schema`), so the core never imports Pydantic. A dict is
checked with the `jsonschema` package (the `schema` extra), imported when a workflow declares
one. Pure values and rules, no I/O.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowlock.core.errors import DefinitionError, InvalidInput
from flowlock.core.extras import require

if TYPE_CHECKING:
    from flowlock.core.definition import Workflow

__all__ = ["InvalidPayload", "PayloadSchema", "early_schemas", "payload_schema"]


class InvalidPayload(InvalidInput):
    """A payload does not match the schema its transition declares; nothing was written.

    Also a create's data that its workflow's `data=` schema refuses (`event` is None then).
    `errors`: one {"loc": [...], "msg": str, "type": str} per bad field, as the validator
    reported it. `paths`: each field as a dotted path ("items.0.sku"; "" for the whole object).
    `workflow`: where the schema is declared ("a, b" when the workflows with the event share it).
    """

    def __init__(
        self,
        errors: Sequence[Mapping[str, Any]],
        *,
        workflow: str,
        event: str | None,
    ) -> None:
        self.errors: tuple[dict[str, Any], ...] = tuple(
            {
                "loc": list(e.get("loc", ())),
                "msg": str(e.get("msg", "")),
                "type": str(e.get("type", "")),
            }
            for e in errors
        )
        self.paths: tuple[str, ...] = tuple(
            ".".join(str(part) for part in e["loc"]) for e in self.errors
        )
        self.workflow = workflow
        self.event = event
        names = ", ".join(repr(name) for name in workflow.split(", "))
        plural = "s" if ", " in workflow else ""
        what = (
            f"the data of a new {workflow!r} instance"
            if event is None
            else f"the payload of event {event!r} (workflow{plural} {names})"
        )
        fields = "; ".join(
            f"{path or '(the whole object)'}: {e['msg']}"
            for path, e in zip(self.paths, self.errors, strict=True)
        )
        super().__init__(
            f"{what} does not match its schema: {fields or 'refused'}; nothing was written. "
            "Correct those fields and send it again"
        )


@dataclass(frozen=True, slots=True, eq=False)
class PayloadSchema:
    """A declared schema, ready to check values.

    `source`: what the definition was given (the model class, or a copy of the dict).
    `json`: its JSON Schema (the model's `model_json_schema()`, or the dict itself), for the
    OpenAPI document and a definition's canonical form. `key`: equal for two schemas that
    check alike (the model class itself; the dict's canonical JSON text).
    `model`: True for a Pydantic model, whose parsed value is a model instance.
    """

    source: Any
    json: Mapping[str, Any]
    key: object
    model: bool
    _check: Callable[[Mapping[str, Any]], tuple[Any, list[dict[str, Any]]]]

    def parse(self, value: Mapping[str, Any], *, workflow: str, event: str | None) -> Any:
        """`value` parsed: a model instance, or the dict itself for a JSON Schema.

        Raises InvalidPayload naming the workflow, the event and every bad field."""
        parsed, errors = self._check(value)
        if errors:
            raise InvalidPayload(errors, workflow=workflow, event=event)
        return parsed


def payload_schema(value: object, owner: str) -> PayloadSchema | None:
    """The schema `value` declares for `owner` (e.g. "transition 'pay'"), or None for None.

    DefinitionError when `value` is neither a Pydantic model class nor a valid JSON Schema.
    """
    if value is None:
        return None
    if isinstance(value, type) and _is_model(value):
        return _model_schema(value, owner)
    if isinstance(value, Mapping):
        return _dict_schema(value, owner)
    raise DefinitionError(
        f"{owner}: a payload schema is a Pydantic model class or a JSON Schema dict, not "
        f"{type(value).__name__} ({value!r})"
    )


def _is_model(cls: type) -> bool:
    return callable(getattr(cls, "model_validate", None)) and callable(
        getattr(cls, "model_json_schema", None)
    )


def _model_schema(model: type, owner: str) -> PayloadSchema:
    try:
        described = model.model_json_schema()  # type: ignore[attr-defined]
    except Exception as exc:
        raise DefinitionError(
            f"{owner}: the model {model.__qualname__} has no JSON Schema ({exc}); use fields "
            "that Pydantic can describe as JSON"
        ) from exc
    validate = model.model_validate  # type: ignore[attr-defined]

    def check(value: Mapping[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        try:
            return validate(value), []
        except ValueError as exc:
            # Pydantic's ValidationError is a ValueError with errors(); duck-typed, so the
            # core needs no import of Pydantic.
            listed = getattr(exc, "errors", None)
            if not callable(listed):
                return None, [{"loc": [], "msg": str(exc), "type": "value_error"}]
            return None, [_plain(e) for e in listed()]
        except Exception as exc:
            # A validator of the model's own that raised something else (a bug in it, by
            # Pydantic's rules): refused like a bad field, so nothing is read or written.
            text = f"the model's validation raised {type(exc).__name__}: {exc}"
            return None, [{"loc": [], "msg": text, "type": "validator_error"}]

    return PayloadSchema(model, described, model, True, check)


def _plain(error: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "loc": list(error.get("loc", ())),
        "msg": str(error.get("msg", "")),
        "type": str(error.get("type", "")),
    }


def _dict_schema(schema: Mapping[str, Any], owner: str) -> PayloadSchema:
    jsonschema = require("jsonschema", "schema", "a payload declared as a JSON Schema dict")
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise DefinitionError(f"{owner}: the JSON Schema is not JSON ({exc})") from exc
    owned: dict[str, Any] = json.loads(text)
    validator_class = jsonschema.validators.validator_for(owned)
    try:
        validator_class.check_schema(owned)
    except jsonschema.SchemaError as exc:
        raise DefinitionError(f"{owner}: the JSON Schema is invalid: {exc.message}") from exc
    validator = validator_class(owned)

    def check(value: Mapping[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        found = sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.path)))
        return value, [_schema_error(e) for e in found]

    return PayloadSchema(copy.deepcopy(owned), owned, text, False, check)


def _schema_error(error: Any) -> dict[str, Any]:
    """One jsonschema error as {"loc", "msg", "type"}; a missing property is named in loc."""
    loc: list[Any] = list(error.absolute_path)
    if error.validator == "required" and isinstance(error.instance, Mapping):
        missing = [p for p in error.validator_value if p not in error.instance]
        named = [p for p in missing if repr(p) in error.message]
        if named:
            loc.append(named[0])
    return {"loc": loc, "msg": error.message, "type": str(error.validator)}


def early_schemas(workflows: Iterable[Workflow]) -> dict[str, tuple[PayloadSchema, str]]:
    """The events whose payload can be checked before anything is read, with the schema and
    the workflows that define them ("a" or "a, b").

    An event qualifies when every workflow defining it declares the same schema: then the
    instance's workflow does not matter. Other typed events are checked in the step.
    """
    found: dict[str, list[tuple[PayloadSchema | None, str]]] = {}
    for wf in workflows:
        for name, t in wf.transitions.items():
            found.setdefault(name, []).append((t.payload, wf.name))
    early: dict[str, tuple[PayloadSchema, str]] = {}
    for event, declared in found.items():
        first = declared[0][0]
        if first is not None and all(s is not None and s.key == first.key for s, _ in declared):
            early[event] = (first, ", ".join(name for _, name in declared))
    return early
