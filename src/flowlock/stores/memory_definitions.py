"""MemoryStore's part as a DefinitionStore: the stored definition versions in a dict."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from flowlock.core.models import Instance
from flowlock.core.versions import DefinitionVersion
from flowlock.stores.memory_outbox import copy_json

__all__ = ["MemoryDefinitions"]


class MemoryDefinitions:
    """Definition versions by workflow, then version (the store's dicts are its own)."""

    _instances: dict[str, Instance]
    _definitions: dict[str, dict[int, DefinitionVersion]]

    def _check(self) -> None: ...  # the store's

    def _init_definitions(self) -> None:
        self._definitions = {}

    async def save_definition(
        self, workflow: str, hash: str, definition: Mapping[str, Any]
    ) -> DefinitionVersion:
        self._check()
        await asyncio.sleep(0)
        # No await from here on: the lookup and the insert are one step on the event loop.
        own = self._definitions.setdefault(workflow, {})
        for stored in own.values():
            if stored.hash == hash:
                return stored
        version = max(own, default=0) + 1
        made = DefinitionVersion(
            workflow, version, hash, datetime.now(UTC), copy_json(definition), new=True
        )
        own[version] = DefinitionVersion(workflow, version, hash, made.created_at, made.definition)
        return made

    def _counted(
        self, stored: DefinitionVersion, counts: Counter[tuple[str, int]]
    ) -> DefinitionVersion:
        return DefinitionVersion(
            stored.workflow,
            stored.version,
            stored.hash,
            stored.created_at,
            copy_json(stored.definition),
            instances=counts[(stored.workflow, stored.version)],
        )

    async def definitions(self, workflow: str | None = None) -> list[DefinitionVersion]:
        self._check()
        await asyncio.sleep(0)
        counts = Counter(
            (i.workflow, i.definition_version)
            for i in self._instances.values()
            if i.definition_version is not None and workflow in (None, i.workflow)
        )
        names = sorted(self._definitions) if workflow is None else [workflow]
        return [
            self._counted(self._definitions[name][v], counts)
            for name in names
            if name in self._definitions
            for v in sorted(self._definitions[name])
        ]

    async def definition(self, workflow: str, version: int) -> DefinitionVersion | None:
        self._check()
        stored = self._definitions.get(workflow, {}).get(version)
        return None if stored is None else self._counted(stored, Counter())
