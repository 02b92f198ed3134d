"""A holder's lease deadlines in a heap: each statement finds what ran out, and the reaper its
next wake, without walking every lease the holder keeps.

Entries are never removed in place. An entry is stale once its lease left the holder's books
or got a new deadline (a renewal pushes a new entry); stale entries are dropped as they reach
the top, and the heap is rebuilt when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Container
from typing import Generic, Protocol, TypeVar

__all__ = ["Deadlines"]


class _Dated(Protocol):
    deadline: float


T = TypeVar("T", bound=_Dated)
_Entry = tuple[float, int, str, T]


class Deadlines(Generic[T]):
    """The deadlines of the leases in `kept` (token to lease), earliest first."""

    def __init__(self, kept: dict[str, T]) -> None:
        self._kept = kept
        self._heap: list[_Entry[T]] = []
        self._order = itertools.count()  # ties: no comparison of the leases themselves

    def add(self, token: str, item: T) -> None:
        """`item` is on the books under `token` with a new deadline."""
        if len(self._heap) > 2 * len(self._kept) + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (item.deadline, next(self._order), token, item))

    def expired(self, now: float) -> list[tuple[str, T]]:
        """Take off the books, and return, every lease whose deadline is `now` or earlier."""
        gone: list[tuple[str, T]] = []
        while self._heap:
            entry = self._heap[0]
            if self._live(entry) and entry[0] > now:
                break
            heapq.heappop(self._heap)
            if self._live(entry):
                del self._kept[entry[2]]
                gone.append((entry[2], entry[3]))
        return gone

    def earliest(self, skip: Container[int] = ()) -> float:
        """The earliest deadline of a lease whose id is not in `skip` (inf: none)."""
        passed: list[_Entry[T]] = []
        found = math.inf
        while self._heap:
            entry = self._heap[0]
            if not self._live(entry):
                heapq.heappop(self._heap)
            elif id(entry[3]) in skip:
                passed.append(heapq.heappop(self._heap))
            else:
                found = entry[0]
                break
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return found

    def clear(self) -> None:
        self._heap.clear()

    def _live(self, entry: _Entry[T]) -> bool:
        deadline, _, token, item = entry
        return self._kept.get(token) is item and item.deadline == deadline
