"""The memory store's replay reads: the [`ReplayStore`][flowlock.stores.replaying.ReplayStore]
methods on its dicts (a mixin of MemoryStore)."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from flowlock.core.models import HistoryEntry, Instance
from flowlock.stores.memory_outbox import copy_json
from flowlock.stores.replaying import ReplayRow

__all__ = ["MemoryReplay"]


class MemoryReplay:
    """MemoryStore's part as a ReplayStore (the store's dicts are its own)."""

    _instances: dict[str, Instance]
    _history: dict[str, list[HistoryEntry]]
    # Each instance's data as its create made it; absent for a restored instance.
    _initial_data: dict[str, Mapping[str, Any]]

    def _check(self) -> None: ...  # the store's

    def _replay_row(self, inst: Instance) -> ReplayRow:
        initial = self._initial_data.get(inst.id)
        history = [
            dataclasses.replace(h, data=copy_json(h.data), payload=copy_json(h.payload))
            for h in self._history[inst.id]
        ]
        shown = inst.evolve(data=copy_json(inst.data))
        return shown, None if initial is None else copy_json(initial), history

    async def replay_batch(self, workflow: str, after: str | None, limit: int) -> list[ReplayRow]:
        self._check()
        await asyncio.sleep(0)  # a round trip yields to the loop; so does this
        start = after or ""
        found = heapq.nsmallest(
            limit,
            (i for i in self._instances.values() if i.workflow == workflow and i.id > start),
            key=lambda i: i.id,
        )
        return [self._replay_row(inst) for inst in found]

    async def replay_instances(self, instance_ids: Sequence[str]) -> list[ReplayRow]:
        self._check()
        await asyncio.sleep(0)
        ids = sorted(set(instance_ids))
        return [self._replay_row(self._instances[i]) for i in ids if i in self._instances]
