"""`engine.check_definition`: replay recorded histories through a new definition before it is
deployed (a mixin of `flowlock.Engine`).

The store reads whole histories in keyset batches (`flowlock.stores.replaying.ReplayStore`); the
pure replay (`flowlock.core.replay`) decides each row again. The next batch is read while this
one is replayed. Nothing is written, and the definition checked need not be registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from typing import Final

from flowlock._calls import check_text
from flowlock.core.definition import Workflow
from flowlock.core.errors import InstanceNotFound, InvalidInput
from flowlock.core.models import InstanceQuery
from flowlock.core.query import MAX_LIMIT
from flowlock.core.replay import Divergence, ReplayReport, replay
from flowlock.core.settings import check_count
from flowlock.stores.base import Store
from flowlock.stores.replaying import ReplayRow, ReplayStore

__all__ = ["REPLAY_BATCH", "ReplayMethods"]

REPLAY_BATCH: Final = 500
"""Instances per store read of a replay."""
_YIELD_EVERY: Final = 50
"""Instances replayed between two yields to the event loop (a few milliseconds of steps)."""
MAX_IDS: Final = 1_000_000
"""The most instances one check takes by id or by sample."""


class _Tally:
    """What the replay of one definition has found so far."""

    def __init__(self, workflow: Workflow, max_payload: int) -> None:
        self.workflow = workflow
        self.max_payload = max_payload
        self.instances = self.transitions = self.unreplayed = self.operator_rows = 0
        self.divergences: list[Divergence] = []

    async def add(self, rows: Sequence[ReplayRow]) -> None:
        """Replay `rows`, yielding to the event loop every few instances: the steps run on the
        loop, and an application's calls sharing it must not wait for a whole batch."""
        for start in range(0, len(rows), _YIELD_EVERY):
            self._replay(rows[start : start + _YIELD_EVERY])
            await asyncio.sleep(0)

    def _replay(self, rows: Sequence[ReplayRow]) -> None:
        for inst, initial, history in rows:
            done = replay(self.workflow, inst, initial, history, max_payload_bytes=self.max_payload)
            self.instances += 1
            self.transitions += done.transitions
            self.unreplayed += done.unreplayed_first
            self.operator_rows += done.operator_rows
            self.divergences.extend(done.divergences)

    def report(self, seconds: float) -> ReplayReport:
        found = sorted(self.divergences, key=lambda d: (d.instance_id, d.version, d.event is None))
        return ReplayReport(
            workflow=self.workflow.name,
            checked_instances=self.instances,
            checked_transitions=self.transitions,
            divergences=tuple(found),
            seconds=seconds,
            unreplayed_first=self.unreplayed,
            operator_rows=self.operator_rows,
        )


def _checked_ids(instance_ids: object) -> list[str]:
    if isinstance(instance_ids, str) or not isinstance(instance_ids, Sequence):
        raise InvalidInput(
            f"instance_ids takes a list of instance ids, not {type(instance_ids).__name__}; "
            "nothing was read"
        )
    ids = list(dict.fromkeys(check_text(i, "instance id") for i in instance_ids))
    if not ids:
        raise InvalidInput("instance_ids is empty: name at least one instance; nothing was read")
    check_count("the number of instance_ids", len(ids), most=MAX_IDS, unit="instances")
    return ids


class ReplayMethods:
    """`flowlock.Engine`'s replay check; the engine is `self`."""

    _store: Store
    _max_payload: int

    def _check_open(self) -> None: ...  # the engine's

    async def check_definition(
        self,
        workflow: Workflow,
        *,
        sample: int | None = None,
        instance_ids: Sequence[str] | None = None,
    ) -> ReplayReport:
        """Replay the recorded histories of `workflow`'s instances through `workflow`, a new
        definition (registered or not), and report every divergence: an applied transition it
        refuses, a guard that now rejects, another target, other data, a state or event it lacks.

        All instances of the workflow (by its name); `sample`: N of them picked at random;
        `instance_ids`: those instances only. Nothing is written. Operator rows (force, pause,
        resume, migrate) are taken as recorded. Guards and effects run as in `fire` (pure, so
        running them again is safe). InvalidInput for bad arguments, before anything is read;
        InstanceNotFound for an id that does not exist.
        """
        self._check_open()
        if not isinstance(workflow, Workflow):
            raise InvalidInput(
                f"check_definition() takes a flowlock.Workflow, not {type(workflow).__name__}"
            )
        if sample is not None and instance_ids is not None:
            raise InvalidInput(
                "give sample= or instance_ids=, not both: a sample is drawn from every "
                "instance of the workflow; nothing was read"
            )
        if sample is not None:
            check_count("sample", sample, most=MAX_IDS, unit="instances")
        ids = None if instance_ids is None else _checked_ids(instance_ids)
        store = self._store
        if not isinstance(store, ReplayStore):
            raise InvalidInput(
                f"this engine's store ({type(store).__name__}) cannot read histories for a "
                "replay; use a memory, SQLite or PostgreSQL store"
            )
        started = time.perf_counter()
        tally = _Tally(workflow, self._max_payload)
        if sample is not None:
            ids = await self._sample(store, workflow.name, sample)
        if ids is None:
            await _walk(store, workflow.name, tally)
        else:
            await _by_id(store, workflow.name, ids, tally)
        return tally.report(time.perf_counter() - started)

    async def _sample(self, store: Store, workflow: str, size: int) -> list[str]:
        """`size` ids of `workflow`'s instances picked uniformly at random (all of them when
        there are fewer): a reservoir over one keyset walk of the instances."""
        rng = random.Random()
        chosen: list[str] = []
        seen = 0
        after: str | None = None
        query = InstanceQuery(workflow=workflow)
        while True:
            page = await store.list_instances(query, after=after, limit=MAX_LIMIT)
            for inst in page:
                seen += 1
                if len(chosen) < size:
                    chosen.append(inst.id)
                elif (at := rng.randrange(seen)) < size:
                    chosen[at] = inst.id
            if len(page) < MAX_LIMIT:
                return chosen
            after = page[-1].id


async def _walk(store: ReplayStore, workflow: str, tally: _Tally) -> None:
    """Every instance of `workflow`, a batch at a time; the next batch is read (its query
    already on the server) while this one is replayed."""
    pending: asyncio.Task[list[ReplayRow]] | None = asyncio.ensure_future(
        store.replay_batch(workflow, None, REPLAY_BATCH)
    )
    try:
        while pending is not None:
            batch = await pending
            pending = None
            if len(batch) == REPLAY_BATCH:
                pending = asyncio.ensure_future(
                    store.replay_batch(workflow, batch[-1][0].id, REPLAY_BATCH)
                )
            await tally.add(batch)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


async def _by_id(store: ReplayStore, workflow: str, ids: list[str], tally: _Tally) -> None:
    """The instances of `ids`, each checked to exist and to run `workflow` before any replay."""
    rows: list[ReplayRow] = []
    for start in range(0, len(ids), REPLAY_BATCH):
        rows += await store.replay_instances(ids[start : start + REPLAY_BATCH])
    found = {inst.id: inst for inst, _, _ in rows}
    for iid in ids:
        inst = found.get(iid)
        if inst is None:
            raise InstanceNotFound(iid)
        if inst.workflow != workflow:
            raise InvalidInput(
                f"instance {iid!r} runs workflow {inst.workflow!r}, not {workflow!r}: a "
                "definition replays only its own workflow's histories; nothing was replayed"
            )
    await tally.add(rows)
