"""The workflows `flowlock serve` serves under `flowlock bench --http`.

The bench starts the service with `--app flowlock_lab.http_app:workflows`.
These are the in-process sessions' definitions, so a call means the same on both transports.
"""

from __future__ import annotations

from flowlock.bench.config import HTTP_SCENARIOS
from flowlock.bench.results import Params
from flowlock.bench.scenarios import SCENARIOS
from flowlock.core.definition import Workflow

__all__ = ["workflows"]


def workflows() -> list[Workflow]:
    """Every workflow the `--http` scenarios use, each once: storm's approval and the counter.

    None depends on the number of callers.
    """
    found: dict[str, Workflow] = {}
    for name in HTTP_SCENARIOS:
        for wf in SCENARIOS[name].workflows(Params()):
            found.setdefault(wf.name, wf)
    return list(found.values())
