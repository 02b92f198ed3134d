"""Versioned workflow definitions: a canonical form, its content hash, and the engine's registry.

A definition's canonical form is plain JSON: states, transitions, strategies, timers, the
payload and data schemas (their JSON Schema, when typed), and the guards, effects and emit
functions by name ("module:qualname"). Two processes that register the
same code get the same hash, so the store gives them the same version. Code is not data: a
lambda is named by a short hash of its source too, so two different lambdas differ.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from flowlock.core.definition import Transition, Workflow
from flowlock.core.errors import DefinitionMismatch
from flowlock.core.payloads import PayloadSchema

__all__ = ["DefinitionVersion", "Registry", "callable_name", "canonical", "content_hash"]


def _code_text(code: Any) -> str:
    """A code object's bytecode and constants, nested code objects included, without the
    memory addresses their repr would show."""
    consts = [_code_text(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    return f"{code.co_code.hex()}|{'|'.join(consts)}"


def _source_hash(fn: Any) -> str:
    """A short hash of `fn`'s source text, or of its code object when the source is gone."""
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        text = "" if code is None else _code_text(code)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def callable_name(fn: Any) -> str | None:
    """A guard's, effect's or emit function's name in the canonical form: "module:qualname",
    with "#" and a hash of the source for a lambda (or a function defined inside another)."""
    if fn is None:
        return None
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or "?"
    qualname: str = getattr(target, "__qualname__", None) or type(fn).__name__
    name = f"{module}:{qualname}"
    if "<lambda>" in qualname or "<locals>" in qualname:
        name += f"#{_source_hash(fn)}"
    return name


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value.total_seconds())


def _schema(schema: PayloadSchema | None) -> dict[str, Any] | None:
    """A declared payload or data schema as its JSON Schema (None: untyped)."""
    return None if schema is None else dict(schema.json)


def _transition(t: Transition) -> dict[str, Any]:
    form: dict[str, Any] = {
        "name": t.name,
        "sources": list(t.sources),
        "targets": list(t.targets),
        "strategy": t.strategy,
        "policy": t.policy,
        "guard": callable_name(t.guard),
        "effect": callable_name(t.effect),
        "emit": callable_name(t.emit),
        "after": _seconds(t.after),
        "every": _seconds(t.every),
        "limit": t.limit,
        "payload": _schema(t.payload),
    }
    return form


def canonical(workflow: Workflow) -> dict[str, Any]:
    """`workflow` as plain JSON: what a stored definition version holds and its hash covers.
    Transitions are sorted by name, so the order they were listed in does not matter."""
    finals = [s for s in workflow.states if not workflow.allowed(s)]
    form: dict[str, Any] = {
        "name": workflow.name,
        "states": list(workflow.states),
        "initial": workflow.initial,
        "finals": finals,
        "strategy": workflow.strategy,
        "policy": workflow.policy,
        "data": _schema(workflow.data),
        "transitions": [_transition(workflow.transitions[n]) for n in sorted(workflow.transitions)],
    }
    if workflow.constraints:
        # Only when there are some: a definition without any keeps the hash it had before.
        form["constraints"] = workflow.constraints.canonical()
    return form


def content_hash(workflow: Workflow | Mapping[str, Any]) -> str:
    """The sha256 (hex) of the canonical form's JSON, keys sorted, compact separators."""
    form = canonical(workflow) if isinstance(workflow, Workflow) else workflow
    text = json.dumps(form, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class DefinitionVersion:
    """One stored version of a workflow's definition.

    `definition` is the canonical form. `new`: the `register` that returned it stored it.
    `instances`: how many instances run it, when listed. It compares equal to its version
    number (`await engine.register(wf) == 2`) and to a version of the same workflow, number
    and hash; `int(v)` is the number.
    """

    workflow: str
    version: int
    hash: str
    created_at: datetime | None
    definition: Mapping[str, Any] = field(repr=False)
    new: bool = False
    instances: int | None = None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DefinitionVersion):
            return (self.workflow, self.version, self.hash) == (
                other.workflow,
                other.version,
                other.hash,
            )
        if isinstance(other, int) and not isinstance(other, bool):
            return self.version == other
        return NotImplemented

    def __hash__(self) -> int:
        # The version's own hash: equal to the int it compares equal to.
        return hash(self.version)

    def __int__(self) -> int:
        return self.version

    def __index__(self) -> int:
        return self.version


class Registry(Mapping[str, Workflow]):
    """The workflows an engine registered, every version of each.

    As a Mapping it gives the newest version per name (the highest number; the one registered
    last when the store keeps no versions). `pinned` finds the version an instance runs.
    """

    def __init__(self) -> None:
        self._newest: dict[str, Workflow] = {}
        self._newest_version: dict[str, int | None] = {}
        self._versions: dict[str, dict[int, Workflow]] = {}

    def add(self, workflow: Workflow, version: int | None) -> None:
        """Register `workflow` as `version` of its name (None: the store keeps no versions)."""
        name = workflow.name
        if version is None:
            self._newest[name], self._newest_version[name] = workflow, None
            return
        own = self._versions.setdefault(name, {})
        own[version] = workflow
        top = max(own)
        self._newest[name], self._newest_version[name] = own[top], top

    def pinned(
        self, name: str, version: int | None, *, instance_id: str | None = None
    ) -> Workflow | None:
        """The workflow `name` at `version` (None: the newest); None when `name` is unknown.
        Raises DefinitionMismatch for a version not registered here."""
        newest = self._newest.get(name)
        if newest is None or version is None:
            return newest
        found = self._versions.get(name, {}).get(version)
        if found is None:
            raise DefinitionMismatch(instance_id, name, version, self.versions(name))
        return found

    def runs(self, name: str, version: int | None) -> Workflow | None:
        """`pinned` without the error: None for an unknown name or a version not registered."""
        try:
            return self.pinned(name, version)
        except DefinitionMismatch:
            return None

    def every(self) -> Iterator[Workflow]:
        """Every workflow registered here, each version of each (the unversioned newest too)."""
        seen: set[int] = set()
        for wf in (
            *self._newest.values(),
            *(w for v in self._versions.values() for w in v.values()),
        ):
            if id(wf) not in seen:
                seen.add(id(wf))
                yield wf

    def versions(self, name: str) -> tuple[int, ...]:
        """The version numbers of `name` registered here, lowest first."""
        return tuple(sorted(self._versions.get(name, ())))

    def newest_version(self, name: str) -> int | None:
        """The newest version number of `name` registered here (None: unknown or unversioned)."""
        return self._newest_version.get(name)

    def __getitem__(self, name: str) -> Workflow:
        return self._newest[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._newest)

    def __len__(self) -> int:
        return len(self._newest)
