"""EmbeddedServerError: the one error an embedded PostgreSQL or Redis raises when it does not start,
does not stop or is not running, and what its message carries."""

from __future__ import annotations

import pytest

import flowlock
from flowlock.errors import EmbeddedServerError, FlowlockError


def test_is_a_flowlock_error_exported_at_the_top() -> None:
    """One hierarchy to catch: it is a FlowlockError, exported as flowlock.EmbeddedServerError."""
    assert issubclass(EmbeddedServerError, FlowlockError)
    assert flowlock.EmbeddedServerError is EmbeddedServerError
    assert "EmbeddedServerError" in flowlock.__all__


def test_message_names_the_server_then_details_then_advice() -> None:
    """The problem (with the server's name) is the first line, the server output below it, and
    the advice last; the facts are attributes."""
    exc = EmbeddedServerError(
        "PostgreSQL",
        "initdb exited with status 1",
        details="  FATAL: no\n",
        advice="raise start_timeout",
    )
    lines = str(exc).splitlines()
    assert lines == [
        "embedded PostgreSQL: initdb exited with status 1",
        "FATAL: no",
        "What to do: raise start_timeout",
    ]
    assert (exc.server, exc.problem, exc.details, exc.advice) == (
        "PostgreSQL",
        "initdb exited with status 1",
        "FATAL: no",
        "raise start_timeout",
    )


def test_without_details_the_message_has_no_empty_section() -> None:
    """No server output: two lines, the problem and the default advice."""
    exc = EmbeddedServerError("Redis", "the server is not running")
    first, advice = str(exc).splitlines()
    assert first == "embedded Redis: the server is not running"
    assert advice.startswith("What to do: ")
    with pytest.raises(FlowlockError, match="not running"):
        raise exc
