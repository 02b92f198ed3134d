"""The one JSON check (flowlock.jsondata.check_object): what it refuses, where it says the problem
is, and the payload comparison of idempotency keys (same_json). Pure functions, no store."""

from __future__ import annotations

import sys
from collections import OrderedDict
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import pytest

import flowlock
from flowlock.jsondata import MAX_DEPTH, check_object, same_json


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
