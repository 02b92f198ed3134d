"""The memory store's retention: the [`RetentionStore`][flowlock.stores.base.RetentionStore]
methods on its dicts (a mixin of MemoryStore). Its clock is the wall clock its commits stamp
`updated_at` with."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.retention import ArchivedInstance, CreateRecord, Hold, PurgeSelection
from flowlock.stores.base import BeforeCommit
from flowlock.stores.memory_outbox import copy_json

__all__ = ["MemoryRetention"]


class MemoryRetention:
    """MemoryStore's part as a RetentionStore (the store's dicts are its own)."""

    _instances: dict[str, Instance]
    _history: dict[str, list[HistoryEntry]]
    _applied: dict[str, dict[str, int]]
    _locks: dict[str, asyncio.Lock]
    _fences: dict[str, int]
    _created: dict[str, Instance]
    _create_keys: dict[str, str]
    _timers: dict[str, Any]  # the store's armed timers, by instance id
    _holds: dict[str, Hold]
    _initial_data: dict[str, Any]  # replay's creation data (MemoryReplay)

    def _check(self) -> None: ...  # the store's

    if TYPE_CHECKING:  # the outbox's (MemoryOutbox)

        def _pending_instances(self) -> set[str]: ...

        def _drop_messages(self, instance_id: str) -> None: ...

        # the constraints' (MemoryConstraints)
        def _free_slots(self, instance_id: str, version: int) -> list[tuple[str, str]]: ...

        def _heard(self, released: Sequence[tuple[str, str]]) -> None: ...

    def _init_retention(self) -> None:
        self._holds = {}

    async def place_hold(self, hold: Hold) -> Hold:
        self._check()
        found = self._holds.get(hold.instance_id)
        if found is None:
            found = dataclasses.replace(hold, at=datetime.now(UTC))
            self._holds[hold.instance_id] = found
        return dataclasses.replace(found, instance_found=hold.instance_id in self._instances)

    async def lift_hold(self, instance_id: str) -> bool:
        self._check()
        return self._holds.pop(instance_id, None) is not None

    async def find_holds(self, *, after: str | None, limit: int) -> list[Hold]:
        self._check()
        start = after or ""
        return sorted((h for i, h in self._holds.items() if i > start), key=_id)[:limit]

    def _taken(self, selection: PurgeSelection) -> list[Instance]:
        """The instances `selection` takes now, holds aside, in no order."""
        bound = datetime.now(UTC) - timedelta(seconds=selection.older_than)
        pending = self._pending_instances()
        return [
            inst
            for inst in self._instances.values()
            if inst.workflow == selection.workflow
            and (selection.states is None or inst.state in selection.states)
            and inst.updated_at is not None
            and inst.updated_at < bound
            and inst.id not in pending
        ]

    async def purge_candidates(
        self, selection: PurgeSelection, *, after: str | None, limit: int
    ) -> list[ArchivedInstance]:
        self._check()
        await asyncio.sleep(0)  # a round trip yields to the loop
        start = after or ""
        found = sorted(
            (i for i in self._taken(selection) if i.id > start and i.id not in self._holds),
            key=lambda i: i.id,
        )[:limit]
        return [self._archived(i) for i in found]

    def _archived(self, inst: Instance) -> ArchivedInstance:
        history = tuple(
            dataclasses.replace(e, data=copy_json(e.data), payload=copy_json(e.payload))
            for e in self._history[inst.id]
        )
        key = self._create_keys.get(inst.id)
        created = None
        if key is not None:
            made = self._created[key]
            created = CreateRecord(key, made.state, copy_json(made.data))
        return ArchivedInstance(
            inst.evolve(data=copy_json(inst.data)),
            history,
            self._fences.get(inst.id),
            created,
        )

    async def count_purgeable(self, selection: PurgeSelection) -> tuple[int, int]:
        self._check()
        await asyncio.sleep(0)
        taken = self._taken(selection)
        held = sum(1 for i in taken if i.id in self._holds)
        return len(taken) - held, held

    async def purge_batch(
        self, victims: Sequence[tuple[str, int]], before_commit: BeforeCommit | None = None
    ) -> list[str]:
        self._check()
        await asyncio.sleep(0)
        # No await from here on: the checks and the deletes are one step on the event loop. An
        # instance whose row lock a pessimistic writer holds is kept: it is being written.
        pending = self._pending_instances()
        doomed = sorted(
            iid
            for iid, version in dict(victims).items()
            if (inst := self._instances.get(iid)) is not None
            and inst.version == version
            and iid not in self._holds
            and iid not in pending
            and not ((lock := self._locks.get(iid)) is not None and lock.locked())
        )
        if before_commit is not None:
            before_commit(doomed)  # raises: nothing is deleted
        released: list[tuple[str, str]] = []
        for iid in doomed:
            # A purge takes final instances, which hold no slot; one that does frees it.
            released += self._free_slots(iid, self._instances[iid].version)
            del self._instances[iid]
            del self._history[iid]
            del self._applied[iid]
            self._initial_data.pop(iid, None)
            self._timers.pop(iid, None)
            self._locks.pop(iid, None)
            key = self._create_keys.pop(iid, None)
            if key is not None:
                del self._created[key]
            self._drop_messages(iid)
            # The fencing floor stays: a restored instance must still refuse older tokens.
        self._heard(released)
        return doomed

    async def restore_instances(self, archived: Sequence[ArchivedInstance]) -> list[str]:
        self._check()
        await asyncio.sleep(0)
        restored: list[str] = []
        for item in archived:
            inst = item.instance
            if inst.id in self._instances:
                continue
            self._instances[inst.id] = inst.evolve(data=copy_json(inst.data), next_timer=None)
            history = [
                dataclasses.replace(e, data=copy_json(e.data), payload=copy_json(e.payload))
                for e in item.history
            ]
            self._history[inst.id] = history
            self._applied[inst.id] = {
                e.request_id: at for at, e in enumerate(history) if e.request_id is not None
            }
            tokens = [t for t in (item.fencing_token, *(e.fencing_token for e in history)) if t]
            if tokens:
                self._fences[inst.id] = max(self._fences.get(inst.id, 0), *tokens)
            made = item.created
            if made is not None and made.request_id not in self._created:
                self._created[made.request_id] = inst.evolve(
                    state=made.state,
                    version=1,
                    data=copy_json(made.data),
                    last_event=None,
                    updated_at=inst.created_at,
                    stay_version=1,
                    next_timer=None,
                    paused=False,
                )
                self._create_keys[inst.id] = made.request_id
            restored.append(inst.id)
        return restored


def _id(hold: Hold) -> str:
    return hold.instance_id
