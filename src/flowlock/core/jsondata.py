"""What flowlock accepts as JSON data: instance data, payloads, effect results.

`check_object` is the one check on every path that writes data. So every strategy
and store refuses the same values with InvalidInput, before any I/O. docs/steps.md lists
what is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from flowlock.core.errors import InvalidInput, PayloadTooLarge

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "MAX_PAYLOAD",
    "check_object",
    "encode",
    "same_json",
]

DEFAULT_MAX_PAYLOAD = 64 * 1024
"""Bytes a payload (or data) may take encoded as JSON, unless `max_payload_bytes`."""

MAX_PAYLOAD = 256 * 1024 * 1024 - 1
"""The largest `max_payload_bytes`: PostgreSQL's `jsonb` holds at most this many bytes."""

MAX_INT_BITS = 1024
"""Integers must be smaller in magnitude than `2 ** MAX_INT_BITS` (about 1.8e308): the numbers a
JSON decoder that reads numbers as doubles can hold, and every float PostgreSQL's `jsonb` gives
back as an integer fits. (Python itself refuses to print an integer of more than 4300 digits.)"""

MAX_DEPTH = 64
"""How deeply objects and arrays may nest (the top-level object is depth 1)."""

_HINT = "Use only objects with string keys, arrays, strings, finite numbers, true, false and null"


def encode(value: Any) -> str:
    """`value` as compact JSON text, as the stores write it (UTF-8, no NaN)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def check_object(value: object, what: str, limit: int) -> dict[str, Any]:
    """`value` (a mapping, or None for `{}`) as a new dict of plain JSON data.

    Raises InvalidInput naming `what` and where in it the problem is. Raises
    PayloadTooLarge over `limit` bytes of JSON.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        name = type(value).__name__
        # A typed payload's model instance is the likely mistake: say how to send its JSON.
        hint = (
            f"; send the model's JSON: {what}=value.model_dump(mode='json')"
            if callable(getattr(value, "model_dump", None))
            else ""
        )
        raise InvalidInput(f"{what} must be a JSON object (a mapping), not {name}{hint}")
    if not value:
        return {}
    plain = _plain(value, what)
    try:
        size = len(encode(plain).encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"{what} holds a string that is not valid Unicode ({exc.reason}: a lone surrogate); "
            "send text that can be encoded as UTF-8"
        ) from None
    if size > limit:
        raise PayloadTooLarge(size, limit, what)
    return plain


def _where(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the top level"


def _refuse(what: str, path: tuple[str | int, ...], problem: str) -> InvalidInput:
    return InvalidInput(f"{what} at {_where(path)}: {problem}; nothing was written. {_HINT}")


def _plain(root: Mapping[Any, Any], what: str) -> dict[str, Any]:
    """A plain copy of `root`, walked with an explicit stack (never recursion)."""
    out: dict[str, Any] = {}
    # Each entry: a container to copy, the empty copy to fill, its depth and its path.
    stack: list[tuple[Any, dict[str, Any] | list[Any], int, tuple[str | int, ...]]] = [
        (root, out, 1, ())
    ]
    while stack:
        source, copy, depth, path = stack.pop()
        if isinstance(copy, dict):
            for key, item in source.items():
                if not isinstance(key, str):
                    raise _refuse(
                        what, path, f"key {key!r} is a {type(key).__name__}, not a string"
                    )
                if "\x00" in key:
                    raise _refuse(what, path, f"key {key!r} contains a NUL character (\\x00)")
                copy[key] = _value(item, what, path, key, depth, stack)
        else:
            for index, item in enumerate(source):
                copy.append(_value(item, what, path, index, depth, stack))
    return out


def _value(
    item: Any,
    what: str,
    path: tuple[str | int, ...],
    key: str | int,
    depth: int,
    stack: list[tuple[Any, dict[str, Any] | list[Any], int, tuple[str | int, ...]]],
) -> Any:
    """The plain copy of one member (containers are copied empty and queued on `stack`)."""
    if item is None or isinstance(item, bool):
        return item
    if isinstance(item, str):
        if "\x00" in item:
            raise _refuse(what, (*path, key), "the string contains a NUL character (\\x00)")
        return str(item)
    if isinstance(item, int):
        if item.bit_length() > MAX_INT_BITS:
            raise _refuse(
                what, (*path, key), f"an integer of {item.bit_length()} bits is not a JSON number "
                f"every reader can hold (the limit is 2**{MAX_INT_BITS}, about 1.8e308)",
            )  # fmt: skip
        return int(item)
    if isinstance(item, float):
        if not math.isfinite(item):
            raise _refuse(what, (*path, key), f"{item!r} is not a JSON number (no NaN or Infinity)")
        return float(item)
    if isinstance(item, Mapping | list | tuple):
        if depth >= MAX_DEPTH:
            raise _refuse(what, (*path, key), f"nested deeper than {MAX_DEPTH} levels")
        copy: dict[str, Any] | list[Any] = {} if isinstance(item, Mapping) else []
        stack.append((item, copy, depth + 1, (*path, key)))
        return copy
    hint = ""
    if hasattr(item, "isoformat"):
        hint = " (store a date or time as text: value.isoformat())"
    raise _refuse(what, (*path, key), f"a {type(item).__name__} is not JSON{hint}")


def same_json(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are the same JSON value.

    Key order does not matter, and numbers compare by value: 1 equals 1.0, and 1e+300 equals
    the integer `jsonb` gives back. A number never equals a bool or a string.
    """
    return bool(_canonical(a) == _canonical(b))


def _canonical(value: Any) -> Any:
    # Tagged, so that true and 1, or "1" and 1, never compare equal. Data given to this function
    # passed check_object (or was read back from a store), so its depth is bounded.
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        # repr: the shortest text that reads back as the same float, which is what was stored.
        return ("number", Decimal(repr(value)) if isinstance(value, float) else Decimal(value))
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, Mapping):
        return ("object", frozenset((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("array", tuple(_canonical(v) for v in value))
    return ("other", repr(value))
