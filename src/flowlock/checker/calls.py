"""A recorded call: what was asked, when, and what came back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from flowlock.core.errors import InvalidInput

Op: TypeAlias = Literal["create", "fire", "get"]
OutcomeName: TypeAlias = Literal["ok", "fail", "unknown"]
OPS: tuple[str, ...] = ("create", "fire", "get")
OUTCOMES: tuple[str, ...] = ("ok", "fail", "unknown")


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One recorded call: what was asked, when, how it ended and what it returned.

    Times are on the recorder's clock. ``completed_at`` is None for a call that never completed.
    ``outcome`` is "ok", "fail" or "unknown". An ok call carries ``state``, ``version``,
    ``data`` and ``workflow``. ``idempotent`` marks a fire that applied nothing.
    ``error`` is what the call raised, as text.

    Frozen and picklable, so worker processes can send theirs back.
    ``to_dict`` and ``from_dict`` carry it through JSON."""

    instance_id: str
    op: str
    event: str | None
    invoked_at: float
    completed_at: float | None
    outcome: str
    state: str | None = None
    version: int | None = None
    data: Mapping[str, Any] | None = None
    error: str | None = None
    idempotent: bool = False
    workflow: str | None = None

    def __post_init__(self) -> None:
        problem = _record_problem(self)
        if problem is not None:
            raise InvalidInput(f"bad call record ({problem}): {self!r}")

    def to_dict(self) -> dict[str, Any]:
        """Every field, ready for JSON (``data`` as a plain dict)."""
        return {
            "instance_id": self.instance_id,
            "op": self.op,
            "event": self.event,
            "invoked_at": self.invoked_at,
            "completed_at": self.completed_at,
            "outcome": self.outcome,
            "state": self.state,
            "version": self.version,
            "data": None if self.data is None else dict(self.data),
            "error": self.error,
            "idempotent": self.idempotent,
            "workflow": self.workflow,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CallRecord:
        """The record :meth:`to_dict` gave; InvalidInput for a field missing or wrong."""
        try:
            return cls(**{name: raw[name] for name in _REQUIRED}, **_optional(raw))
        except KeyError as exc:
            raise InvalidInput(f"call record is missing {exc.args[0]!r}: {dict(raw)!r}") from None

    def label(self) -> str:
        """A short description: op, event, outcome and what it returned."""
        what = self.op if self.event is None else f"{self.op} {self.event!r}"
        if self.outcome != "ok":
            return f"{what} {self.outcome}"
        seen = f"v{self.version} {self.state!r}"
        return f"{what} ok{' (idempotent)' if self.idempotent else ''} -> {seen}"


_REQUIRED = ("instance_id", "op", "event", "invoked_at", "completed_at", "outcome")
_OPTIONAL = ("state", "version", "data", "error", "idempotent", "workflow")


def _optional(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {name: raw[name] for name in _OPTIONAL if name in raw}


def _record_problem(r: CallRecord) -> str | None:
    """What is wrong with a record's fields, or None."""
    if not isinstance(r.instance_id, str):
        return "instance_id must be a string"
    if r.op not in OPS:
        return f"op must be one of {OPS}"
    if r.outcome not in OUTCOMES:
        return f"outcome must be one of {OUTCOMES}"
    if r.op == "fire" and not isinstance(r.event, str):
        return "a fire needs its event"
    if not isinstance(r.invoked_at, int | float):
        return "invoked_at must be a number"
    if r.outcome == "unknown":
        return None
    if not isinstance(r.completed_at, int | float):
        return f"a call that ended {r.outcome} needs completed_at"
    if r.completed_at < r.invoked_at:
        return "completed_at is before invoked_at"
    if r.outcome == "ok":
        return _result_problem(r)
    return None


def _result_problem(r: CallRecord) -> str | None:
    if not isinstance(r.state, str):
        return "an ok call needs the state it returned"
    if not isinstance(r.version, int) or isinstance(r.version, bool) or r.version < 1:
        return "an ok call needs the version it returned (an integer, 1 or more)"
    if not isinstance(r.data, Mapping):
        return "an ok call needs the data it returned (a mapping)"
    if r.idempotent and r.op != "fire":
        return "only a fire can be idempotent"
    return None
