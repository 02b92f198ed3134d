"""What the OpenAPI document says about typed payloads and data: the document only.

Each declared schema becomes a component: `<workflow>.<event>` for a transition's payload,
`<workflow>._data` for a workflow's creation data (an event name starts with a letter, so
the two never meet). The fire route's `payload` and the create route's `data` list them
(anyOf), and their description maps each event or workflow to its schema. A schema's own
`$defs` become components of their own, `<name>.<Def>`, and its `$ref`s point there.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from flowlock.core.definition import Workflow
from flowlock.core.payloads import PayloadSchema

__all__ = ["document_payloads"]

_FIRE = "/instances/{instance_id}/events/{event}"
_CREATE = "/instances"
_REF = "#/components/schemas/"
_ANY_OTHER = {"type": "object", "title": "Any JSON object", "additionalProperties": True}


def document_payloads(schema: dict[str, Any], workflows: Sequence[Workflow]) -> dict[str, Any]:
    """`schema` with the served workflows' payload and data schemas; unchanged when none
    is typed."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    events: list[tuple[str, str, str]] = []  # (workflow, event, component)
    data: list[tuple[str, str]] = []  # (workflow, component)
    untyped_event = untyped_data = False
    for wf in workflows:
        for t in wf.transitions.values():
            if t.payload is None:
                untyped_event = True
            else:
                events.append((wf.name, t.name, _add(components, f"{wf.name}.{t.name}", t.payload)))
        if wf.data is None:
            untyped_data = True
        else:
            data.append((wf.name, _add(components, f"{wf.name}._data", wf.data)))
    if events:
        lines = [f"- `{event}` (workflow `{wf}`): `{name}`" for wf, event, name in events]
        body = _body(schema, _FIRE)
        _list(body, "payload", [name for _, _, name in events], lines, untyped_event)
        body.setdefault("x-flowlock-payloads", {}).update(
            {f"{wf}.{event}": _REF + name for wf, event, name in events}
        )
    if data:
        lines = [f"- workflow `{wf}`: `{name}`" for wf, name in data]
        body = _body(schema, _CREATE)
        _list(body, "data", [name for _, name in data], lines, untyped_data)
        body.setdefault("x-flowlock-data", {}).update({wf: _REF + name for wf, name in data})
    return schema


def _body(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """The JSON request body schema of the POST at `path`."""
    found: dict[str, Any] = schema["paths"][path]["post"]["requestBody"]["content"][
        "application/json"
    ]["schema"]
    return found


def _list(
    body: dict[str, Any], member: str, names: list[str], lines: list[str], untyped: bool
) -> None:
    """Make `body.properties[member]` any of the named components (and any object, when some
    event or workflow declares none)."""
    field: dict[str, Any] = body["properties"][member]
    options: list[dict[str, Any]] = [{"$ref": _REF + name} for name in names]
    if untyped:
        options.append(dict(_ANY_OTHER))
    kept = {k: v for k, v in field.items() if k in ("default", "description", "title")}
    rest = "; any other takes any JSON object" if untyped else ""
    kept["description"] = (
        f"{kept.get('description', '')}\n\nThese declare a schema (a component of this "
        f"document), checked before anything is read (422 invalid-payload){rest}:\n"
        + "\n".join(lines)
    ).strip()
    kept["anyOf"] = options
    body["properties"][member] = kept


def _add(components: dict[str, Any], wanted: str, declared: PayloadSchema) -> str:
    """Add `declared` as the component `wanted` (made unique) with its `$defs` beside it;
    its name."""
    name = _unique(components, wanted)
    root = copy.deepcopy(dict(declared.json))
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        defs.update(root.pop(key, None) or {})
    renamed = {d: _unique(components, f"{name}.{d}", reserved=name) for d in defs}
    local = {
        f"#/{key}/{d}": _REF + new for d, new in renamed.items() for key in ("$defs", "definitions")
    }
    components[name] = _rewrite(root, local)
    for d, new in renamed.items():
        components[new] = _rewrite(defs[d], local)
    return name


def _unique(components: dict[str, Any], wanted: str, reserved: str | None = None) -> str:
    name, n = wanted, 1
    while name in components or name == reserved:
        n += 1
        name = f"{wanted}-{n}"
    return name


def _rewrite(value: Any, local: dict[str, str]) -> Any:
    """`value` with each `$ref` to a local definition pointed at its component."""
    if isinstance(value, dict):
        return {
            k: (local.get(v, v) if k == "$ref" and isinstance(v, str) else _rewrite(v, local))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_rewrite(v, local) for v in value]
    return value
