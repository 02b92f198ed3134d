"""The command line's one age parser (flowlock.cli._age): its units, its bound, its refusals."""

from __future__ import annotations

from datetime import timedelta

import pytest
import typer

from flowlock.cli._age import MAX_AGE, age_or_none, parse_age


def test_every_unit_from_seconds_to_weeks() -> None:
    got = [parse_age(a) for a in ("45s", "30m", "12h", "90d", "2w", " 3d ")]
    assert got == [
        timedelta(seconds=45), timedelta(minutes=30), timedelta(hours=12), timedelta(days=90),
        timedelta(weeks=2), timedelta(days=3),
    ]  # fmt: skip


def test_the_bound_is_taken_and_past_it_is_a_usage_error() -> None:
    assert parse_age(f"{MAX_AGE.days}d") == MAX_AGE
    for text in (f"{MAX_AGE.days + 1}d", "99999999999d", "5300w", "9" * 5000 + "s"):
        with pytest.raises(typer.BadParameter, match="too long an age"):
            parse_age(text)
        with pytest.raises(typer.BadParameter, match="too long an age"):
            age_or_none(text, "--updated-before")


def test_what_is_not_an_age() -> None:
    for text in ("90", "d", "1y", "-1d", "1.5h", ""):
        assert age_or_none(text, "--updated-before") is None
        with pytest.raises(typer.BadParameter, match="not an age"):
            parse_age(text)
    assert age_or_none("0s", "--updated-before") == timedelta(0)  # now, for a time
    with pytest.raises(typer.BadParameter, match="above 0"):
        parse_age("0d")  # an age to purge by is above 0
