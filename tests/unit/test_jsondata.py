"""The one JSON check (flowlock.core.jsondata.check_object): what it refuses, where it says
the problem is, and the payload comparison of idempotency keys (same_json).
Pure functions, no store."""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.core.jsondata import MAX_DEPTH, MAX_INT_BITS, check_object, encode, same_json


def deep(levels: int) -> dict[str, Any]:
    """A dict nested ``levels`` deep, built without recursion."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


REFUSED: dict[str, tuple[Any, str]] = {
    "NaN": ({"x": float("nan")}, "NaN"),
    "Infinity nested in a list": ({"x": [1, {"y": float("inf")}]}, "['x'][1]['y']"),
    "-Infinity": ({"x": float("-inf")}, "-inf"),
    "NUL in a value": ({"note": "a\x00b"}, "NUL"),
    "NUL in a key": ({"a\x00": 1}, "NUL"),
    "NUL in a nested key": ({"x": {"k\x00": 1}}, "NUL"),
    "a datetime": ({"at": datetime(2024, 1, 1, tzinfo=UTC)}, "isoformat()"),
    "a set": ({"tags": {"a"}}, "set is not JSON"),
    "bytes": ({"blob": b"x"}, "bytes is not JSON"),
    "an int key": ({1: "a"}, "not a string"),
    "a lone surrogate": ({"x": "\ud800"}, "surrogate"),
    "a lone surrogate in a key": ({"\udc80": 1}, "surrogate"),
    "an integer no double holds": ({"n": [2**MAX_INT_BITS]}, f"2**{MAX_INT_BITS}"),
    "a negative one": ({"n": -(2**MAX_INT_BITS)}, "['n']"),
    "10,000 levels deep": (deep(10_000), f"deeper than {MAX_DEPTH}"),
    "a cycle": (None, f"deeper than {MAX_DEPTH}"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_values_are_invalid_input(case: str) -> None:
    """Every value a store could not keep (or would keep altered) is InvalidInput, naming the
    value and where in it; never a RecursionError, a TypeError or a StoreError."""
    value, said = REFUSED[case]
    if value is None:
        cycle: dict[str, Any] = {}
        cycle["self"] = cycle
        value = cycle
    with pytest.raises(flowlock.InvalidInput) as caught:
        check_object(value, "payload", 64 * 1024)
    assert said in str(caught.value)
    assert str(caught.value).startswith("payload")


def test_depth_limit_is_exact() -> None:
    assert check_object(deep(MAX_DEPTH), "data", 10**6)
    with pytest.raises(flowlock.InvalidInput):
        check_object(deep(MAX_DEPTH + 1), "data", 10**6)


def test_a_deep_value_does_not_recurse() -> None:
    """Checked with an explicit stack: far deeper than the interpreter's recursion limit."""
    with pytest.raises(flowlock.InvalidInput):
        check_object(deep(sys.getrecursionlimit() * 20), "data", 10**9)


def test_oversized_is_payload_too_large() -> None:
    with pytest.raises(flowlock.PayloadTooLarge) as caught:
        check_object({"x": "y" * 100}, "data", 50)
    assert (caught.value.limit, caught.value.what) == (50, "data")
    assert caught.value.size == len('{"x":""}') + 100


def test_accepted_values_come_back_as_plain_json() -> None:
    """Mappings of any kind and tuples become dicts and lists; the value is copied, not aliased."""
    given = {"m": MappingProxyType({"a": (1, 2.5, None, True)}), "o": OrderedDict(b="é")}
    plain = check_object(given, "data", 1000)
    assert plain == {"m": {"a": [1, 2.5, None, True]}, "o": {"b": "é"}}
    assert type(plain["m"]) is dict and type(plain["m"]["a"]) is list
    assert check_object(None, "data", 2) == {} and check_object({}, "data", 2) == {}


def test_same_json_compares_values_not_spelling() -> None:
    """Key order and 1 vs 1.0 do not matter; types do (a number is not a boolean or a string)."""
    assert same_json({"a": 1, "b": [1, {"c": 2}]}, {"b": [1, {"c": 2}], "a": 1})
    assert same_json({"n": 1}, {"n": 1.0})
    assert same_json({"n": 1e300}, {"n": 10**300})  # what PostgreSQL's jsonb gives back
    assert not same_json({"n": 1}, {"n": True})
    assert not same_json({"n": 1}, {"n": "1"})
    assert not same_json({"n": [1, 2]}, {"n": [2, 1]})
    assert not same_json({}, {"comment": "ok"})


def test_integers_up_to_a_doubles_range_are_kept() -> None:
    """Every float's integer value is accepted (PostgreSQL's jsonb gives 1e308 back as an int,
    and data read back must pass the check again when an effect keeps it)."""
    top = int(sys.float_info.max)
    assert check_object({"n": top, "m": -top}, "data", 10**4) == {"n": top, "m": -top}


def test_thousands_of_digits_are_invalid_input_not_value_error() -> None:
    """Python refuses to print an int of more than 4300 digits (a raw ValueError from
    json.dumps); the check refuses it first."""
    with pytest.raises(flowlock.InvalidInput, match="integer"):
        check_object({"n": 10**5000}, "data", 10**6)


# Anything a caller might pass: JSON and not JSON, any characters (NUL, surrogates), any ints
# and floats (NaN, infinities, beyond a double), keys of other types, nesting.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**1000, max_value=2**1100)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.binary(max_size=4)
    | st.datetimes()
)
_KEYS = st.text() | st.integers() | st.none() | st.booleans()
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(_KEYS, inner, max_size=4)
        | st.frozensets(st.integers(), max_size=2)
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=5) | _VALUES)
def test_what_is_accepted_round_trips_and_what_is_not_is_invalid_input(value: object) -> None:
    """Anything check_object accepts comes back unchanged from JSON text a store can keep
    (UTF-8, no NaN, no NUL); anything it refuses raises InvalidInput, never another error."""
    try:
        plain = check_object(value, "data", 10**6)
    except flowlock.InvalidInput:
        return
    text = encode(plain)
    text.encode("utf-8")  # storable: valid UTF-8
    back = json.loads(text, parse_constant=_no_constant)
    assert back == plain and same_json(back, plain)
    assert not any("\x00" in s for s in _strings(back))  # PostgreSQL's jsonb refuses NUL


def _no_constant(name: str) -> object:
    raise AssertionError(f"{name} in the stored JSON")


def _strings(value: object) -> list[str]:
    """Every string in ``value``, keys included."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            found.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found
