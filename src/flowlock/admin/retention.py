"""The engine's retention: legal holds, purge with an archive, restore (a mixin of
`flowlock.Engine`). docs/operations.md, "Retention: purge, archive, restore, holds", is the
operator's guide."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from pathlib import Path

from flowlock._calls import check_text
from flowlock.admin.archive import (
    ArchiveMark,
    ArchiveWriter,
    check_new,
    encode_line,
    read_archive,
)
from flowlock.core.errors import InvalidInput, OutcomeUnknown, UnknownWorkflow
from flowlock.core.retention import (
    ArchivedInstance,
    Hold,
    PurgeReport,
    PurgeSelection,
    RestoreReport,
)
from flowlock.core.settings import check_count, check_flag
from flowlock.core.versions import Registry
from flowlock.stores.base import RetentionStore, Store

__all__ = ["DEFAULT_PURGE_BATCH", "MAX_PURGE_BATCH", "SETTLE_BOUND", "RetentionMethods"]

log = logging.getLogger("flowlock")

DEFAULT_PURGE_BATCH = 500
"""Instances per purge (and restore) transaction, unless `batch=`."""
MAX_PURGE_BATCH = 10_000
"""The most instances one purge transaction deletes: its row locks are held until it commits."""
SETTLE_BOUND = 60.0
"""The most seconds a cancelled purge waits for the batch in flight to end (it is one short
transaction, bounded by the store's own lock and statement bounds)."""
_MAX_HOLDS_PAGE = 10_000


def _older_than(value: object) -> float:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidInput(
            f"older_than must be a positive datetime.timedelta (how long since an instance's "
            f"last transition), not {value!r}; nothing was purged"
        )
    return value.total_seconds()


def _optional_text(value: object, what: str) -> str | None:
    return None if value is None else check_text(value, what)


class RetentionMethods:
    """`flowlock.Engine`'s holds, purge and restore; the engine is `self`."""

    _store: Store
    _workflows: Registry

    def _check_open(self) -> None: ...  # the engine's

    def _retention(self) -> RetentionStore:
        self._check_open()
        store = self._store
        if not isinstance(store, RetentionStore):
            raise InvalidInput(
                f"{type(store).__name__} keeps no holds and cannot purge; use a store that can "
                "(memory, SQLite or PostgreSQL of this flowlock version)"
            )
        return store

    # -- holds --------------------------------------------------------------------------------

    async def hold(
        self, instance_id: str, *, reason: str | None = None, actor: str | None = None
    ) -> Hold:
        """Place a legal hold on `instance_id`: no purge deletes it while the hold stands.
        Idempotent: an instance held already keeps its first hold (returned as it is).

        The id need not exist (a hold may come before a restore): the hold is placed anyway,
        and the returned hold's `instance_found` is False. Check it: False also means a purge
        deleted the instance before the hold (a hold placed while a purge batch runs waits for
        that batch, then reports what it left)."""
        check_text(instance_id, "instance_id")
        hold = Hold(instance_id, _optional_text(reason, "reason"), _optional_text(actor, "actor"))
        placed = await self._retention().place_hold(hold)
        log.info("flowlock: hold on %r by %r (%s)", instance_id, placed.actor, placed.reason)
        if not placed.instance_found:
            log.warning(
                "flowlock: hold on %r placed, but no instance has that id (purged already, or "
                "not created or restored yet)",
                instance_id,
            )
        return placed

    async def unhold(self, instance_id: str, *, actor: str | None = None) -> bool:
        """Lift the hold on `instance_id`; False when there was none. `actor` is logged."""
        check_text(instance_id, "instance_id")
        _optional_text(actor, "actor")
        lifted = await self._retention().lift_hold(instance_id)
        if lifted:
            log.info("flowlock: hold on %r lifted by %r", instance_id, actor)
        return lifted

    async def holds(self, *, after: str | None = None, limit: int = 100) -> list[Hold]:
        """At most `limit` holds (1 to 10,000), by instance id in code point order, after
        the id `after` (the last of the previous page)."""
        if after is not None:
            check_text(after, "after")
        check_count("limit", limit, most=_MAX_HOLDS_PAGE, unit="holds")
        return await self._retention().find_holds(after=after, limit=limit)

    # -- purge --------------------------------------------------------------------------------

    def _purge_states(
        self, workflow: str, final: bool, states: Collection[str] | None
    ) -> tuple[str, ...] | None:
        """The states a purge may delete from (None: any), checked against the definition."""
        named = None if states is None else tuple(dict.fromkeys(states))
        if named is not None:
            if isinstance(states, str) or not named:
                raise InvalidInput(f"states must be a non-empty list of names, not {states!r}")
            for state in named:
                check_text(state, "a state")
        if not final:
            return named
        wf = self._workflows.get(workflow)
        if wf is None:
            raise UnknownWorkflow(workflow, tuple(self._workflows))
        finals = tuple(s for s in wf.states if wf.is_final(s))
        if named is None:
            if not finals:
                raise InvalidInput(
                    f"workflow {workflow!r} has no final state (every state has a way out); "
                    "name the states to purge with states= and final=False"
                )
            return finals
        not_final = [s for s in named if s not in finals]
        if not_final:
            raise InvalidInput(
                f"{not_final} of workflow {workflow!r} are not final states (final: "
                f"{list(finals)}); pass final=False to purge them. Nothing was purged"
            )
        return named

    async def purge(
        self,
        workflow: str,
        *,
        older_than: timedelta,
        final: bool = True,
        states: Collection[str] | None = None,
        archive: str | os.PathLike[str] | None = None,
        batch: int = DEFAULT_PURGE_BATCH,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> PurgeReport:
        """Delete the instances of `workflow` whose last transition is older than `older_than`
        (on the database's clock), with their history, timers, outbox messages and create
        record, in keyset batches of `batch` (id order), each batch one short transaction.

        `final` (the default): only instances in a final state of the registered definition
        (UnknownWorkflow when it is not registered). `states`: only these states (with `final`,
        each must be final). A held instance is never purged, nor one with an outbox message
        still to deliver. Each delete is a compare-and-swap on the version read: an instance
        that moved meanwhile is kept (`kept`).

        `archive`: a new file (never overwritten) that gets every deleted instance with its
        history, gzip JSON Lines, written and fsynced before its batch's delete commits; its
        manifest is written at the end (also when the purge fails midway).

        `dry_run`: count only (`matched`, `held`), delete nothing. `progress`: called after each
        batch with how many instances the batch handled (deleted or kept).
        """
        check_text(workflow, "workflow")
        seconds = _older_than(older_than)
        check_flag("final", final)
        check_flag("dry_run", dry_run)
        check_count("batch", batch, most=MAX_PURGE_BATCH, unit="instances")
        selection = PurgeSelection(workflow, self._purge_states(workflow, final, states), seconds)
        if archive is not None:
            check_new(archive)
        store = self._retention()
        matched, held = await store.count_purgeable(selection)
        report = PurgeReport(
            workflow, selection.states, seconds, dry_run, matched, held,
            archive=None if archive is None else Path(archive),
        )  # fmt: skip
        if dry_run:
            return report
        writer = None
        if archive is not None:
            meta = {
                "workflow": workflow,
                "bound": {"older_than_seconds": seconds, "final": final,
                          "states": None if selection.states is None else list(selection.states)},
            }  # fmt: skip
            writer = ArchiveWriter(archive, meta)
        try:
            return await _purge_batches(store, selection, report, writer, batch, progress)
        finally:
            if writer is not None:
                writer.close()

    # -- restore ------------------------------------------------------------------------------

    async def restore(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        batch: int = DEFAULT_PURGE_BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> RestoreReport:
        """Insert every instance of the archive at `path` with its history and create record,
        verbatim (versions, request ids, timestamps, fencing tokens), `batch` per transaction.
        An id that exists is skipped (listed in `skipped`), its archived history with it.

        `verify` (the default): the manifest must match the file (sha256, line count) and every
        line must decode, else [`ArchiveInvalid`][flowlock.ArchiveInvalid] before anything is
        written. `verify=False` reads an archive without a manifest (a purge that crashed),
        up to its last complete line. `progress`: called after each batch with its size."""
        check_flag("verify", verify)
        check_count("batch", batch, most=MAX_PURGE_BATCH, unit="instances")
        store = self._retention()
        lines = restored = 0
        skipped: list[str] = []
        pending: list[ArchivedInstance] = []

        async def flush() -> None:
            nonlocal restored
            inserted = set(await store.restore_instances(pending))
            restored += len(inserted)
            skipped.extend(item.instance.id for item in pending if item.instance.id not in inserted)
            if progress is not None:
                progress(len(pending))
            pending.clear()

        for item in read_archive(path, verify=verify):
            lines += 1
            pending.append(item)
            if len(pending) >= batch:
                await flush()
        if pending:
            await flush()
        return RestoreReport(Path(path), lines, restored, tuple(skipped))


async def _purge_batches(
    store: RetentionStore,
    selection: PurgeSelection,
    report: PurgeReport,
    writer: ArchiveWriter | None,
    batch: int,
    progress: Callable[[int], None] | None,
) -> PurgeReport:
    """The purge's keyset walk: read a batch of candidates, delete it (archiving first)."""
    purged = kept = batches = 0
    longest = 0.0
    after: str | None = None
    while True:
        found = await store.purge_candidates(selection, after=after, limit=batch)
        if not found:
            break
        after = found[-1].instance.id
        deleted = await _one_batch(store, found, writer)
        batches += 1
        longest = max(longest, deleted[1])
        purged += len(deleted[0])
        kept += len(found) - len(deleted[0])
        if progress is not None:
            progress(len(found))
        if len(found) < batch:
            break
    return PurgeReport(
        report.workflow, report.states, report.older_than, False, report.matched, report.held,
        purged, kept, batches, longest, report.archive,
    )  # fmt: skip


async def _one_batch(
    store: RetentionStore, found: Sequence[ArchivedInstance], writer: ArchiveWriter | None
) -> tuple[list[str], float]:
    """Delete one batch; the ids deleted and how long its transaction took (seconds)."""
    victims = [(item.instance.id, item.instance.version) for item in found]
    if writer is None:
        started = time.monotonic()
        gone = await store.purge_batch(victims)
        return gone, time.monotonic() - started
    # Encoded before the transaction: inside it, only the write and the fsync.
    lines = {item.instance.id: encode_line(item) for item in found}

    def before_commit(ids: Sequence[str]) -> None:
        assert writer is not None
        writer.write([lines[i] for i in ids])

    mark = writer.mark()
    started = time.monotonic()
    running = asyncio.ensure_future(store.purge_batch(victims, before_commit))
    try:
        gone = await asyncio.shield(running)
    except asyncio.CancelledError:
        # Cut back only once the batch's outcome is known: SQLite's transaction runs on in its
        # thread and may commit, PostgreSQL's COMMIT may be in flight. So the batch (one short,
        # bounded transaction) ends on its own, and the writer is not closed under its write.
        await _settle(running)
        _after_cancel(running, writer, mark)
        raise
    except OutcomeUnknown:
        raise  # the delete may have committed: its lines stay in the archive
    except Exception:
        writer.undo(mark)  # rolled back: nothing of this batch was deleted
        raise
    return gone, time.monotonic() - started


async def _settle(running: asyncio.Future[list[str]]) -> None:
    """Wait for a cancelled purge's batch to end, through further cancellations, at most
    SETTLE_BOUND seconds."""
    deadline = time.monotonic() + SETTLE_BOUND
    while not running.done() and (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({running}, timeout=left)


def _after_cancel(
    running: asyncio.Future[list[str]], writer: ArchiveWriter, mark: ArchiveMark
) -> None:
    """The archive after a cancelled purge's last batch: its lines stay if it committed (or
    may have), and go if it rolled back."""
    if not running.done():
        log.error(
            "flowlock: purge cancelled; its last batch did not end within %s s, so its lines "
            "stay in the archive (restore skips an id that exists)",
            SETTLE_BOUND,
        )
        return
    failed = None if running.cancelled() else running.exception()
    if failed is not None and not isinstance(failed, OutcomeUnknown):
        writer.undo(mark)
