"""Ages on the command line (`30m`, `2h`, `7d`, `2w`): one parser for every command that takes
one (`admin purge --older-than`, the bulk commands' `--updated-before/--updated-after`)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Final

import typer

__all__ = ["AGE_FORMS", "MAX_AGE", "age_or_none", "parse_age"]

MAX_AGE: Final = timedelta(days=36_525)
"""The longest age taken: 100 years. Longer ones cannot name a time (before year 1, say)."""
AGE_FORMS: Final = "a whole number and a unit: s, m, h, d or w (seconds to weeks), e.g. 90d"

# Digits capped so that a pasted number cannot cost a huge int's parse; MAX_AGE bounds the rest.
_AGE: Final = re.compile(r"([0-9]{1,12})([smhdw])")
_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def age_or_none(text: str, option: str) -> timedelta | None:
    """`text` as an age, or None when it is not shaped like one (so a caller may read it as
    something else, a time). An age over MAX_AGE, or with too many digits to be one, is a
    usage error (typer.BadParameter: exit 2)."""
    text = text.strip()
    found = _AGE.fullmatch(text)
    if found is None:
        if re.fullmatch(r"[0-9]+[smhdw]", text):
            _too_long(text, option)
        return None
    seconds = int(found.group(1)) * _SECONDS[found.group(2)]
    if seconds > MAX_AGE.total_seconds():
        _too_long(text, option)
    return timedelta(seconds=seconds)


def parse_age(text: str, option: str = "--older-than") -> timedelta:
    """`text` (`90d`, `12h`, `2w`...) as a timedelta above 0; a usage error otherwise."""
    age = age_or_none(text, option)
    if age is None or not age:
        raise typer.BadParameter(
            f"{text!r} is not an age: {AGE_FORMS}, above 0", param_hint=f"'{option}'"
        )
    return age


def _too_long(text: str, option: str) -> None:
    raise typer.BadParameter(
        f"{text!r} is too long an age: at most {MAX_AGE.days}d (100 years)",
        param_hint=f"'{option}'",
    )
