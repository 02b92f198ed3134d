"""How the runner reports progress (`Progress`), and a front end that shows nothing.

The rich display is `flowlock.bench.report.RichProgress`.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NullProgress", "Progress"]


class Progress(Protocol):
    """Told what the runner is doing, so a front end can show it. Must not block."""

    def status(self, message: str) -> None:
        """A step outside the measured rounds (starting a server, connecting...)."""

    def plan(self, rounds: int) -> None:
        """The whole run's rounds (warm-ups included), told once before the first pair."""

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        """A pair starts; `rounds` counts the warm-up round too."""

    def advance(self) -> None:
        """One round of the current pair finished."""

    def end(self) -> None:
        """The current pair finished."""


class NullProgress:
    """Progress that shows nothing."""

    def status(self, message: str) -> None:
        pass

    def plan(self, rounds: int) -> None:
        pass

    def begin(self, scenario: str, strategy: str, rounds: int) -> None:
        pass

    def advance(self) -> None:
        pass

    def end(self) -> None:
        pass
