"""What `flowlock diagram module:attr` draws: the workflows a reference names.

`attr` may be dotted, and name a Workflow, a list of them, or a function returning
either. The current directory is importable, as with `python -m`.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType

from flowlock.core.definition import Workflow
from flowlock.core.errors import FlowlockError, InvalidInput

__all__ = ["BadReference", "load_workflows", "render"]

_FORM = "module:attr, e.g. myapp.flows:approval"


class BadReference(InvalidInput):
    """The reference does not name workflows.

    A typo, a missing module or attribute, or an attribute of the wrong kind. Fix the
    reference.
    """


def load_workflows(reference: str) -> list[Workflow]:
    """The workflows `reference` names.

    Raises BadReference for a reference that names none. An exception from the module or
    the function propagates: a FlowlockError as it is, anything else wrapped in one.
    """
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise BadReference(f"{reference!r} is not a reference of the form {_FORM}")
    module = _import(module_name)
    value: object = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise BadReference(
                f"module {module_name!r} has no attribute {attr!r} (looked for {part!r}); "
                f"give {_FORM}"
            )
        value = getattr(value, part)
    if callable(value) and not isinstance(value, Workflow):
        value = _call(value, reference)
    found = _workflows(value)
    if found is None:
        raise BadReference(
            f"{reference} is of type {type(value).__name__}; it must be a flowlock.Workflow, a "
            "list of them, or a function returning one or a list of them"
        )
    return found


def render(workflows: list[Workflow]) -> str:
    """Each workflow's Mermaid text, headed by `%% workflow: name`, blank-line separated."""
    if len(workflows) == 1:
        return workflows[0].to_mermaid()
    return "\n".join(f"%% workflow: {wf.name}\n{wf.to_mermaid()}" for wf in workflows)


def _import(name: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # The module itself (or a package above it) is missing: a bad reference. A module that
        # exists but imports something missing is the module's own failure, reported as such.
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise BadReference(
                f"no module named {name!r} (from {cwd}); check the spelling, or run from the "
                "directory that holds it"
            ) from None
        raise _failed(f"importing {name!r}", exc) from exc
    except FlowlockError:
        raise
    except Exception as exc:
        raise _failed(f"importing {name!r}", exc) from exc


def _call(fn: Callable[..., object], reference: str) -> object:
    try:
        return fn()
    except FlowlockError:
        raise
    except Exception as exc:
        raise _failed(f"calling {reference}()", exc) from exc


def _failed(doing: str, exc: Exception) -> FlowlockError:
    return FlowlockError(f"{doing} failed: {type(exc).__name__}: {exc}")


def _workflows(value: object) -> list[Workflow] | None:
    if isinstance(value, Workflow):
        return [value]
    if isinstance(value, list | tuple) and value and all(isinstance(w, Workflow) for w in value):
        return list(value)
    return None
