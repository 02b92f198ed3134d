"""The arguments of `Engine.list` and `Engine.count`, checked before I/O, and the cursor.

Results come in id order, and a cursor holds the last id of a page. The cursor is opaque
text; a string that is not one raises InvalidInput. docs/queries.md explains the order.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Final, TypedDict

from flowlock.core.definition import _NAME
from flowlock.core.errors import InvalidInput
from flowlock.core.models import InstanceQuery

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "MAX_STATES",
    "check_limit",
    "cursor_after",
    "decode_cursor",
    "instance_query",
]

DEFAULT_LIMIT: Final = 100
"""Instances per page unless `limit=`."""
MAX_LIMIT: Final = 1000
"""The largest page `limit` accepts."""
MAX_STATES: Final = 100
"""The most states one query may name."""

_CURSOR_TAG: Final = b"i1:"  # "keyset on id", version 1 of the encoding
_CURSOR: Final = re.compile(r"[A-Za-z0-9_-]{1,1200}")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _name(value: object, what: str) -> str:
    """A workflow or state name, checked as a Workflow would check it.

    A malformed name is an error. A well-formed name nobody registered finds nothing.
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidInput(
            f"{what} {value!r} is not a valid name (a letter, then letters, digits, '_', '.', "
            "'-'; at most 100 characters)"
        )
    return value


def _states(state: object) -> tuple[str, ...] | None:
    if state is None:
        return None
    if isinstance(state, str):
        return (_name(state, "state"),)
    if not isinstance(state, Collection) or isinstance(state, bytes | Mapping):
        raise InvalidInput(
            f"state takes a state name or a list of them, not {type(state).__name__}"
        )
    named: Collection[object] = state
    if not named:
        raise InvalidInput("state is an empty list, which matches nothing; give a state or None")
    if len(named) > MAX_STATES:
        raise InvalidInput(f"state names {len(named)} states; the limit is {MAX_STATES}")
    # Sorted and without repeats: the same states give the same statement (and the same plan).
    return tuple(sorted({_name(s, "state") for s in named}))


def _moment(value: object, what: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidInput(f"{what} takes a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidInput(
            f"{what} is a naive datetime ({value.isoformat()}); give a timezone-aware one, "
            "e.g. datetime.now(UTC) - timedelta(days=1)"
        )
    return value


def instance_query(
    workflow: object, state: object, updated_before: object, updated_after: object
) -> InstanceQuery:
    """The filters of `list` / `count`, checked. InvalidInput names the bad one."""
    before = _moment(updated_before, "updated_before")
    after = _moment(updated_after, "updated_after")
    if before is not None and after is not None and after >= before:
        raise InvalidInput(
            f"updated_after ({after.isoformat()}) is not earlier than updated_before "
            f"({before.isoformat()}), so nothing could match; did you swap them?"
        )
    return InstanceQuery(
        workflow=None if workflow is None else _name(workflow, "workflow"),
        states=_states(state),
        updated_before=before,
        updated_after=after,
    )


def check_limit(limit: object) -> int:
    """The page size: an int from 1 to MAX_LIMIT."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidInput(f"limit must be an integer from 1 to {MAX_LIMIT}, not {limit!r}")
    return limit


class HistoryRange(TypedDict):
    """A history page's bounds, as `Store.history` takes them."""

    after: int
    limit: int | None


def history_range(after: object, limit: object) -> HistoryRange:
    """A history page's bounds, checked: `after` a version (an int >= 0), `limit` None (every
    entry after it) or an int >= 1."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise InvalidInput(f"after must be a version, an integer >= 0, not {after!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidInput(f"limit must be None (every entry) or an integer >= 1, not {limit!r}")
    return HistoryRange(after=after, limit=limit)


def cursor_after(instance_id: str) -> str:
    """The cursor of the position just after `instance_id`."""
    raw = base64.urlsafe_b64encode(_CURSOR_TAG + instance_id.encode("utf-8"))
    return raw.rstrip(b"=").decode("ascii")


def decode_cursor(cursor: object) -> str | None:
    """The id a cursor from `cursor_after` names (None: start at the beginning)."""
    if cursor is None:
        return None
    bad = InvalidInput(
        f"after={cursor!r} is not a cursor; pass a page's next_cursor exactly as it was given "
        "(or None for the first page)"
    )
    if not isinstance(cursor, str) or not _CURSOR.fullmatch(cursor):
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        text = raw.removeprefix(_CURSOR_TAG).decode("utf-8") if raw.startswith(_CURSOR_TAG) else ""
    except (binascii.Error, UnicodeDecodeError):
        raise bad from None
    if not text or _CONTROL.search(text):
        raise bad
    return text
