"""Facts about the machine for the report, and the event loop every process runs on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

__all__ = ["cores", "loop_factory", "loop_name"]


def cores() -> int:
    """CPUs this process may run on (not the machine's count, under a container limit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def loop_name() -> str:
    """`"uvloop"` or `"asyncio"`: the event loop running now."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory when uvloop is installed (asyncpg's advice), else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
