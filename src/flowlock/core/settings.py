"""Checks for every number and name flowlock is given, in one place, before any I/O.

So every entry point refuses the same nonsense with the same message. Numbers are never
bools, always finite, and capped to catch unit mistakes. Text has no NUL or lone surrogate.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Literal, TypeAlias

from flowlock.core.errors import InvalidInput

__all__ = [
    "DEFAULT_ACQUIRE_TIMEOUT",
    "DEFAULT_APPLICATION_NAME",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_MAX_SIZE",
    "DEFAULT_MIN_SIZE",
    "MAX_CONNECTIONS",
    "MAX_NAMESPACE",
    "MAX_SECONDS",
    "POOLING_CHOICES",
    "POSTGRES_SCHEMES",
    "PoolingChoice",
    "check_application_name",
    "check_count",
    "check_number",
    "check_pooling",
    "check_seconds",
    "check_size",
    "check_text",
    "check_url",
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
DEFAULT_COMMAND_TIMEOUT = 30.0
"""Seconds one round trip to PostgreSQL may take on the client's clock beyond the lock wait the
server bounds itself (`lock_timeout`): a statement that may wait for a lock gets that wait
plus this; past it the connection is closed and the call raises ConnectionLost (OutcomeUnknown
once a write may have been sent). Long enough for a slow query on a large table, short enough
that a server that stopped answering (paused, a half-open network) fails the call."""
DEFAULT_APPLICATION_NAME = "flowlock"
"""How a flowlock-built pool's connections show in `pg_stat_activity`."""

MAX_SECONDS = 3600.0
"""No bound of flowlock's is meant to be longer than an hour; a longer one is a unit mistake."""
POSTGRES_SCHEMES = ("postgresql", "postgres")
"""The schemes of a PostgreSQL URL."""
MAX_NAMESPACE = 200
"""The longest namespace of a lock backend, in characters."""
MAX_CONNECTIONS = 262_143
"""The most connections a pool may be asked for: PostgreSQL's own ceiling on max_connections."""

# PostgreSQL keeps NAMEDATALEN - 1 = 63 bytes of an application_name and turns anything but
# printable ASCII into '?' or escapes: refuse both rather than show something else than was given.
_NAME_BYTES = 63
_URL_LENGTH = 4096
_NUL = re.compile("\x00")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# A lone surrogate cannot be encoded as UTF-8: found by one search, with no copy of the text
# (ids and keys are checked on every call).
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_seconds(
    name: str, value: object, *, zero: bool = False, most: float = MAX_SECONDS
) -> float:
    """`value` as seconds: a finite number above 0 and at most `most`.

    0 itself passes when `zero` means something for this bound. Anything else raises
    InvalidInput naming `name`.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number of seconds, not {value!r}")
    seconds = float(value)
    low = "0 or more" if zero else "more than 0"
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise InvalidInput(f"{name} must be a finite number of seconds, {low}; not {value!r}")
    if seconds > most:
        raise InvalidInput(f"{name} is {seconds:g} s; the limit is {most:g} s (a unit mistake?)")
    return seconds


def check_flag(name: str, value: object) -> bool:
    """`value` as a bool: True or False, nothing truthy in their place."""
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be True or False, not {value!r}")
    return value


PoolingChoice: TypeAlias = Literal["auto", "session", "transaction"]
"""What sits between flowlock and PostgreSQL (`connect(pooling=...)`): "auto" finds out when
opening; "session" is a direct connection or session pooling; "transaction" is a transaction
pooler such as PgBouncer's `pool_mode=transaction`."""

POOLING_CHOICES: tuple[PoolingChoice, ...] = ("auto", "session", "transaction")


def check_pooling(value: object) -> PoolingChoice:
    """`value` if it is one of `POOLING_CHOICES`, else InvalidInput."""
    for choice in POOLING_CHOICES:
        if isinstance(value, str) and value == choice:
            return choice
    raise InvalidInput(
        "pooling must be 'auto' (find out when opening), 'session' (a direct connection or "
        f"session pooling) or 'transaction' (PgBouncer pool_mode=transaction), not {value!r}"
    )


def check_count(name: str, value: object, *, least: int = 1, most: int, unit: str = "") -> int:
    """`value` as a whole number (an int, not a bool) from `least` to `most`.

    `unit` says what it counts, in the message.
    """
    what = f" of {unit}" if unit else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be a whole number{what}, not {value!r}")
    if not least <= value <= most:
        raise InvalidInput(f"{name} must be from {least} to {most}, not {value}")
    return value


def check_size(name: str, value: object, *, least: int = 1) -> int:
    """`value` as a count of connections: an int from `least` to `MAX_CONNECTIONS`."""
    return check_count(name, value, least=least, most=MAX_CONNECTIONS, unit="connections")


def check_number(
    name: str, value: object, *, above: float | None = None, least: float | None = None,
    below: float | None = None, most: float | None = None,
) -> float:  # fmt: skip
    """`value` as a finite int or float (not a bool) within the bounds given.

    `above` and `below` are exclusive; `least` and `most` inclusive.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number, not {value!r}")
    number = float(value)
    ok = math.isfinite(number)
    wanted = ["a finite number"]
    for bound, words, holds in (
        (above, "more than", operator.gt),
        (least, "at least", operator.ge),
        (below, "less than", operator.lt),
        (most, "at most", operator.le),
    ):
        if bound is not None:
            wanted.append(f"{words} {bound:g}")
            ok = ok and holds(number, bound)
    if not ok:
        raise InvalidInput(f"{name} must be {', '.join(wanted)}; not {value!r}")
    return number


def check_text(name: str, value: object, *, most: int, allow_control: bool = False) -> str:
    """`value` as a non-empty str of at most `most` characters every store can hold.

    No NUL, which PostgreSQL's `text` refuses, and no lone surrogate, which UTF-8 cannot
    encode. No control character at all unless `allow_control`.
    """
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidInput(f"{name} must not be empty")
    if len(value) > most:
        raise InvalidInput(f"{name} is {len(value)} characters long; the limit is {most}")
    bad = _NUL if allow_control else _CONTROL
    if bad.search(value):
        kind = "a NUL" if allow_control else "a NUL or control"
        raise InvalidInput(f"{name} {value!r} contains {kind} character; no store can hold it")
    if _SURROGATE.search(value):
        raise InvalidInput(
            f"{name} {value!r} holds a lone surrogate, which is not valid Unicode text "
            "(it cannot be encoded as UTF-8)"
        )
    return value


def check_url(name: str, value: object, schemes: tuple[str, ...]) -> str:
    """`value` as a URL of one of `schemes`, without NUL or lone surrogates.

    The message shows only the scheme: a URL may carry a password.
    """
    text = check_text(name, value, most=_URL_LENGTH, allow_control=True)
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme not in schemes:
        expected = " or ".join(f"{s}://" for s in schemes)
        given = f"it starts with {scheme}://" if scheme else "it has no scheme"
        raise InvalidInput(f"{name} must start with {expected} ({given})")
    return text


def check_application_name(value: object) -> str:
    """A name PostgreSQL shows as given in `pg_stat_activity`.

    1 to 63 printable ASCII characters.
    """
    if not isinstance(value, str):
        raise InvalidInput(f"application_name must be a string, not {type(value).__name__}")
    if not value or len(value) > _NAME_BYTES or not all(" " <= c <= "~" for c in value):
        raise InvalidInput(
            f"application_name {value!r} must be 1 to {_NAME_BYTES} printable ASCII characters "
            "(PostgreSQL truncates or rewrites anything else)"
        )
    return value
