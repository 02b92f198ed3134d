"""``async with`` for anything with ``open()`` and ``aclose()``."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncResource"]


class AsyncResource:
    """Mixin: ``async with x:`` opens ``x`` and closes it on the way out, error or not."""

    async def open(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
