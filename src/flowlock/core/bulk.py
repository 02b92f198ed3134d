"""What a bulk operation is, before any I/O: its actions, its report, its operation id and the
request id each instance gets. Pure; the engine's `bulk` (flowlock.admin.bulk) runs it.

docs/operations.md ("Bulk operations") says how a run walks, retries and resumes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, TypeAlias, get_args

from flowlock.core.errors import InvalidInput
from flowlock.core.models import Instance

__all__ = [
    "BULK_ACTIONS",
    "BULK_PREFIX",
    "MAX_OPERATION_ID",
    "BulkAction",
    "BulkReport",
    "bulk_request_id",
    "check_operation_id",
    "derive_operation_id",
]

BulkAction: TypeAlias = Literal["force", "pause", "resume", "fire"]
BULK_ACTIONS: Final[tuple[str, ...]] = get_args(BulkAction)
BULK_PREFIX: Final = "bulk:"
"""Every request id a bulk operation writes starts with it: `bulk:<operation_id>:<instance>`."""
MAX_OPERATION_ID: Final = 64
_OPERATION_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,{MAX_OPERATION_ID - 1}}}")
# The engine's limit on a caller's request id (flowlock._calls.MAX_ID_LENGTH; core cannot
# import it, the test of this module holds the two equal).
_MAX_REQUEST_ID: Final = 200
_DERIVED_LENGTH: Final = 16  # hex digits of sha256: 64 bits, never two runs by chance


@dataclass(frozen=True)
class BulkReport:
    """What [`Engine.bulk`][flowlock.Engine.bulk] did, or with `dry_run`, would select.

    - `operation_id`: the run's id; each instance's request id is
      `bulk:<operation_id>:<instance_id>`. Run again under it to finish an interrupted run.
    - `matched`: how many instances matched the filters when the run began (one count).
    - `applied`: instances this run changed.
    - `skipped`: instances with nothing to do: already in the wanted condition (paused, say),
      or no longer matching the filters when their turn came (moved meanwhile).
    - `replayed`: instances done earlier under this operation id (a rerun), answered from
      their history and not done again. What was done then may have been undone since (an
      instance resumed after a bulk pause): to do it again, run under another operation id.
    - `failed`: instance id -> the typed error that refused it (`"TransitionNotAllowed: ..."`).
    - `sample`: the first instances of the selection, in id order, as read before the run.
    - `stopped`: why the run ended before walking the whole selection (`max_failures`
      reached), else None.
    """

    operation_id: str
    action: str
    dry_run: bool
    matched: int
    applied: int = 0
    skipped: int = 0
    failed: Mapping[str, str] = field(default_factory=dict)
    sample: tuple[Instance, ...] = ()
    stopped: str | None = None
    replayed: int = 0

    @property
    def done(self) -> int:
        """Instances walked: applied + skipped + replayed + failed."""
        return self.applied + self.skipped + self.replayed + len(self.failed)

    @property
    def only_replayed(self) -> bool:
        """The run applied nothing and found work of an earlier run under its operation id:
        the same operation sent twice, most likely meant as a new one."""
        return self.replayed > 0 and self.applied == 0

    def replay_note(self, new_id: str) -> str | None:
        """What to tell the operator about the replays, or None when there were none.
        `new_id` says how to give another operation id where the reader is (a CLI option,
        a JSON field)."""
        if not self.replayed:
            return None
        return (
            f"{self.replayed} were done earlier by operation {self.operation_id} (a rerun) and "
            f"not done again; {new_id} to run the operation again"
        )

    @property
    def ok(self) -> bool:
        """Nothing failed and the run was not stopped."""
        return not self.failed and self.stopped is None

    def summary(self) -> dict[str, Any]:
        """Every field but the sample, as JSON-ready values (the CLI's and HTTP's answer add
        the sample in their own shape)."""
        return {
            "operation_id": self.operation_id,
            "action": self.action,
            "dry_run": self.dry_run,
            "matched": self.matched,
            "applied": self.applied,
            "skipped": self.skipped,
            "replayed": self.replayed,
            "failed": dict(self.failed),
            "stopped": self.stopped,
        }


def check_operation_id(value: object) -> str:
    """A caller's operation id: a letter or digit, then letters, digits, `_`, `.`, `-`, at most
    MAX_OPERATION_ID characters (no `:`, so a request id splits back into its parts)."""
    if not isinstance(value, str) or not _OPERATION_ID.fullmatch(value):
        raise InvalidInput(
            f"operation_id {value!r} is not valid: a letter or digit, then letters, digits, "
            f"'_', '.', '-' (at most {MAX_OPERATION_ID} characters); or leave it out to have one "
            "derived from the arguments"
        )
    return value


def _plain(value: object) -> object:
    """`value` as JSON can hold it, the same every time: datetimes in ISO form, sets sorted."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(str(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def derive_operation_id(action: str, arguments: Mapping[str, Any]) -> str:
    """An operation id derived from `action` and `arguments` (what selects and what is done,
    as given): the same arguments give the same id, so running the same call again after a
    crash replays what was done and does the rest. Anything else gives another id."""
    text = json.dumps(
        {"action": action, **{k: _plain(v) for k, v in arguments.items()}},
        sort_keys=True,
        ensure_ascii=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:_DERIVED_LENGTH]


def bulk_request_id(operation_id: str, instance_id: str) -> str:
    """`bulk:<operation_id>:<instance_id>`, the request id of one instance's call in a run.

    When that would pass the engine's limit on a request id (a long instance id), the id part
    is `sha256:<hex of the instance id>` instead: still one per instance, and the same on every
    run. A request id is kept per instance, so the hash never meets another instance's."""
    head = f"{BULK_PREFIX}{operation_id}:"
    rid = head + instance_id
    if len(rid) <= _MAX_REQUEST_ID:
        return rid
    return (
        head + "sha256:" + hashlib.sha256(instance_id.encode("utf-8", "surrogatepass")).hexdigest()
    )
