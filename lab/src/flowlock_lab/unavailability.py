"""How long a fault left callers without a successful call, seen from the callers' side.


seen = Availability()
... every caller: began = time.monotonic(); call; seen.ok(began) when it succeeded ...
kill_the_primary()
seen.fault()  # once it is dead
... load goes on until calls succeed again ...
print(f"{seen.window():.2f} s without a successful call")
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["Availability"]


class Availability:
    """When calls succeeded, and when the fault came. `clock` is injectable for tests."""

    __slots__ = ("_clock", "_fault", "_first_after", "_successes")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._successes = 0
        self._fault: float | None = None
        self._first_after = math.inf

    def ok(self, began: float) -> None:
        """A call that began at `began` (on the same clock) succeeded just now."""
        ended = self._clock()
        self._successes += 1
        if self._fault is not None and began >= self._fault:
            self._first_after = min(self._first_after, ended)

    def fault(self) -> None:
        """The fault has just happened; call it once the server is dead.

        A call that began before may have done its part with the server while it was alive.
        """
        self._fault = self._clock()
        self._first_after = math.inf

    @property
    def successes(self) -> int:
        """How many calls succeeded."""
        return self._successes

    def recovered(self) -> bool:
        """Whether a call that began after the fault has succeeded."""
        return self._first_after < math.inf

    def window(self) -> float:
        """Seconds from the fault to the end of the first successful call begun after it.

        A call begun before the fault does not end the window.
        It may have used the failed server first.
        It is `inf` while there is none, and 0.0 before any fault.
        """
        if self._fault is None:
            return 0.0
        return self._first_after - self._fault
