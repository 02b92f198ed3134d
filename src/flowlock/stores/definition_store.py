"""The [`DefinitionStore`][flowlock.stores.base.DefinitionStore] port (re-exported by
`flowlock.stores.base`, beside the other ports): where versioned definitions are kept."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from flowlock.core.versions import DefinitionVersion

__all__ = ["DefinitionStore"]


@runtime_checkable
class DefinitionStore(Protocol):
    """Where workflow definitions are kept, one row per (workflow, version) (every store is one).

    A version is the content hash of a canonical form (flowlock.core.versions); the same hash
    is always the same version, a new hash gets the next number."""

    async def save_definition(
        self, workflow: str, hash: str, definition: Mapping[str, Any]
    ) -> DefinitionVersion:
        """The version of `workflow` whose hash is `hash`: the stored one (`new` False), or a
        new one numbered max + 1 (`new` True). Safe when many processes save at once: a unique
        (workflow, hash) and a primary key (workflow, version), the loser reading or retrying."""
        ...

    async def definitions(self, workflow: str | None = None) -> list[DefinitionVersion]:
        """Every stored version (of `workflow` when given), by workflow then version, each with
        `instances`: how many instances are pinned to it."""
        ...

    async def definition(self, workflow: str, version: int) -> DefinitionVersion | None:
        """The stored version `version` of `workflow`, or None."""
        ...
