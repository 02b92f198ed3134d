"""The checks of the bounds and names an engine is configured with (``Engine.connect``'s keywords,
the stores' and the pool factory's arguments), in one place, so every entry point refuses the same
nonsense with the same message before any I/O.

No driver is imported here: a SQLite-only user's ``Engine.connect`` checks its arguments too.
"""

from __future__ import annotations

import math

from flowlock.errors import InvalidInput

__all__ = [
    "DEFAULT_ACQUIRE_TIMEOUT",
    "DEFAULT_APPLICATION_NAME",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_MAX_SIZE",
    "DEFAULT_MIN_SIZE",
    "MAX_SECONDS",
    "check_application_name",
    "check_seconds",
    "check_size",
]

DEFAULT_MAX_SIZE = 20
"""Connections a PostgreSQL pool built by flowlock opens at most."""
DEFAULT_MIN_SIZE = 1
"""Connections it opens up front."""
DEFAULT_ACQUIRE_TIMEOUT = 10.0
"""Seconds a call waits for a free PostgreSQL pool connection before StoreBusy."""
DEFAULT_CONNECT_TIMEOUT = 10.0
"""Seconds opening one PostgreSQL connection may take."""
DEFAULT_LOCK_TIMEOUT = 5.0
"""Seconds a write waits for a row lock: the pessimistic preset's bound and, on PostgreSQL and the
memory store, an optimistic compare-and-swap's wait for a row lock's holder."""
DEFAULT_APPLICATION_NAME = "flowlock"
"""How a flowlock-built pool's connections show in ``pg_stat_activity``."""

MAX_SECONDS = 3600.0
"""No bound of flowlock's is meant to be longer than an hour; a longer one is a unit mistake."""

# PostgreSQL keeps NAMEDATALEN - 1 = 63 bytes of an application_name and turns anything but
# printable ASCII into '?' or escapes: refuse both rather than show something else than was given.
_NAME_BYTES = 63


def check_seconds(
    name: str, value: object, *, zero: bool = False, most: float = MAX_SECONDS
) -> float:
    """``value`` as seconds: a finite number above 0 (or 0 itself, when ``zero`` means something
    for this bound) and at most ``most``; anything else raises InvalidInput naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number of seconds, not {value!r}")
    seconds = float(value)
    low = "0 or more" if zero else "more than 0"
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise InvalidInput(f"{name} must be a finite number of seconds, {low}; not {value!r}")
    if seconds > most:
        raise InvalidInput(f"{name} is {seconds:g} s; the limit is {most:g} s (a unit mistake?)")
    return seconds


def check_size(name: str, value: object, *, least: int = 1) -> int:
    """``value`` as a count of connections: an int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be a whole number of connections, not {value!r}")
    if value < least:
        raise InvalidInput(f"{name} must be at least {least}, not {value}")
    return value


def check_application_name(value: object) -> str:
    """A name PostgreSQL shows as given in ``pg_stat_activity``: 1 to 63 printable ASCII
    characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"application_name must be a string, not {type(value).__name__}")
    if not value or len(value) > _NAME_BYTES or not all(" " <= c <= "~" for c in value):
        raise InvalidInput(
            f"application_name {value!r} must be 1 to {_NAME_BYTES} printable ASCII characters "
            "(PostgreSQL truncates or rewrites anything else)"
        )
    return value
