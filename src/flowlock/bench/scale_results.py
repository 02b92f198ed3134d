"""The figures of `flowlock bench --scale`, its sizes and its aims: data only, no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final

from flowlock.core.errors import InvalidInput

__all__ = [
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "SLOPE_AIMS",
    "THROUGHPUTS",
    "ScaleConfig",
    "ScaleReport",
    "parse_sizes",
]

DEFAULT_SIZES: Final = (10_000, 100_000, 1_000_000)
QUICK_SIZES: Final = (1_000, 4_000)
_MOST: Final = 10_000_000
SLOPE_AIMS: Final = {"fire p99": 1.5, "spread applied/s": 1.5}
"""The issue's aims: at the largest size at most this many times costlier than at the smallest."""
THROUGHPUTS: Final = frozenset({"spread applied/s"})
"""Figures where more is better: their slope is the smallest size's over the largest's."""


def parse_sizes(text: str, *, quick: bool = False) -> tuple[int, ...]:
    """Sizes from `--scale`: "default", or counts separated by commas (10000, 1e4, 10^4).

    "default" is 10^4, 10^5 and 10^6, or 10^3 and 4 x 10^3 with `quick`.
    """
    if text.strip() == "default":
        return QUICK_SIZES if quick else DEFAULT_SIZES
    sizes: list[int] = []
    for part in text.split(","):
        word = part.strip().replace("_", "")
        m = re.fullmatch(r"(\d{1,8})(?:(e|\^)(\d{1,2}))?", word)
        if m is None:
            raise InvalidInput(
                f"--scale: {part.strip()!r} is not a count; give counts separated by commas, "
                "e.g. --scale 1e4,1e5,1e6 (or --scale default for those)"
            )
        base, power = int(m[1]), int(m[3] or 0)
        sizes.append(base * 10**power if m[2] == "e" else base**power if m[2] else base)
    if sorted(set(sizes)) != sizes or not sizes[0] >= 100 or sizes[-1] > _MOST:
        raise InvalidInput(
            f"--scale: sizes must grow, each from 100 to {_MOST:,} instances; got {text!r}"
        )
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """What `--scale` runs: the sizes, and `quick` for fewer calls at each."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    quick: bool = False
    seed: int | None = None
    database_url: str | None = None


@dataclass(frozen=True, slots=True)
class ScaleReport:
    """Every figure at every size, and where and how it was measured."""

    sizes: tuple[int, ...]
    history_rows: tuple[int, ...]
    figures: tuple[dict[str, float], ...]
    """Per size: metric name -> value (ms, applied/s, or bytes for the tables)."""
    load_s: tuple[float, ...]
    """Per size: seconds to load its schema."""
    flowlock_version: str
    postgres_version: str
    cores: int
    database: str
    seed: int
    quick: bool
    duration_s: float
    args: dict[str, Any] = field(default_factory=dict)
    log: tuple[str, ...] = ()
    """What flowlock logged at WARNING and above, one line per kind of message."""
    rounds: tuple[tuple[dict[str, float], ...], ...] = ()
    """Per size, each round's figures (`figures` holds their medians, and the tables' sizes)."""

    def slope(self, metric: str) -> float | None:
        """How many times costlier `metric` is at the largest size than at the smallest."""
        first, last = self.figures[0].get(metric), self.figures[-1].get(metric)
        if first is None or last is None or len(self.sizes) < 2:
            return None
        low, high = (last, first) if metric in THROUGHPUTS else (first, last)
        return high / low if low > 0 else None

    def metrics(self) -> list[str]:
        """The metric names, in the order they were measured."""
        return list(self.figures[0]) if self.figures else []
