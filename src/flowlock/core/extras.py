"""Optional dependencies, imported where a feature first needs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from flowlock.core.errors import ExtraNotInstalled
from flowlock.core.install import pip_install

__all__ = ["require"]


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise ExtraNotInstalled naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.partition(".")[0] != module.partition(".")[0]:
            raise  # the module is there but broken: its own error says more
        raise ExtraNotInstalled(extra, feature, module, pip_install(extra)) from exc
