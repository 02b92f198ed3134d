"""The narrow ports every store implements: [`Store`][flowlock.stores.base.Store] (memory, SQLite,
PostgreSQL) and, for the stores that can share the adaptive strategy's escalations,
[`EscalationBoard`][flowlock.stores.base.EscalationBoard].

Strategies see only this Protocol. Two ways to apply a transition:

- `read` then `commit`: an unlocked read and a version compare-and-swap that appends the
  history row in the same transaction (the optimistic path, and the distributed one under a lease);
- `apply_locked`: read under a row lock, run a pure `plan` on what was read, write, commit
  (the pessimistic path). `plan` is synchronous and pure so a store may run it on its own thread.

Both take a batch: the engine decides several calls on one instance in memory, in order, and
writes their k history entries with ONE compare-and-swap from version v to v + k. One call is a
batch of one: `commit` and `plan` take a sequence of entries, `read` and `apply_locked` a
sequence of request ids (empty: none), and `Snapshot.priors` holds the entries found.
`commit_many` writes the batches of several instances at once (one
round trip where the store can), each instance's compare-and-swap independent of the others.

Every write is a compare-and-swap on `version`, and, when the entry carries a lease's fencing
token, on that token too (lower than the last one written: refused); a stale write changes nothing.

Queries (`list_instances`, `count_instances`) read instances by an
[`InstanceQuery`][flowlock.core.models.InstanceQuery]; a page is a keyset on the id, in code point
order.

A store that can also run inside a transaction its caller opened (PostgreSQL) is a
[`TransactionalStore`][flowlock.stores.base.TransactionalStore]: it hands out a Store bound to the
caller's connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from flowlock.core.admin import WorkflowPause
from flowlock.core.constraints import Claim, ConstraintRefused
from flowlock.core.errors import InvalidInput
from flowlock.core.models import (
    PAUSE_EVENT,
    RESUME_EVENT,
    Escalation,
    HistoryEntry,
    Instance,
    InstanceQuery,
    Snapshot,
    Timer,
    Timing,
)
from flowlock.core.outbox import Message
from flowlock.core.retention import ArchivedInstance, Hold, PurgeSelection
from flowlock.core.versions import DefinitionVersion
from flowlock.stores.constraint_store import ConstraintStore

__all__ = [
    "ArmedSignal",
    "ConstraintStore",
    "DefinitionStore",
    "EscalationBoard",
    "LockedResult",
    "OutboxStore",
    "PauseStore",
    "Plan",
    "RetentionStore",
    "RowLock",
    "Store",
    "TimerStore",
    "TransactionalStore",
    "entries_of",
]


def entries_of(entries: Sequence[HistoryEntry]) -> tuple[HistoryEntry, ...]:
    """`entries` as a tuple, checked to be one instance's contiguous batch: at least one entry,
    one instance id, versions that follow each other, no request id twice, a pause or resume
    entry only last (the store sets the instance's `paused` from the batch's last entry). A store
    calls it before anything is written; InvalidInput says what is wrong (a strategy's bug, never
    a caller's)."""
    batch = tuple(entries)
    if not batch:
        raise InvalidInput("a commit takes at least one history entry; nothing was written")
    first = batch[0]
    seen: set[str] = set()
    for i, entry in enumerate(batch):
        if entry.instance_id != first.instance_id or entry.version != first.version + i:
            raise InvalidInput(
                f"a batch writes one instance at versions {first.version} to "
                f"{first.version + len(batch) - 1} in order; entry {i} is "
                f"{entry.instance_id!r} at version {entry.version}. Nothing was written"
            )
        if entry.request_id is not None:
            if entry.request_id in seen:
                raise InvalidInput(
                    f"request id {entry.request_id!r} appears twice in one batch for "
                    f"{first.instance_id!r}; nothing was written"
                )
            seen.add(entry.request_id)
        if entry.event in (PAUSE_EVENT, RESUME_EVENT) and i != len(batch) - 1:
            raise InvalidInput(
                f"entry {i} of a batch for {first.instance_id!r} is a {entry.event!r} row, which "
                "must be its batch's last (the engine runs pauses and resumes alone); nothing "
                "was written"
            )
    return batch


@dataclass(frozen=True, slots=True)
class RowLock:
    """How to wait for the instance's row lock: at most `timeout` seconds, or not at all
    (`nowait`, which raises [`flowlock.LockBusy`][flowlock.LockBusy] at once)."""

    timeout: float = 5.0
    nowait: bool = False


Plan = Callable[[Snapshot], Sequence[HistoryEntry] | None]
"""Given what was read under the lock, the history entries to append (versions read + 1 ...
read + k), or None (or an empty sequence) to write nothing. May raise a
[`flowlock.FlowlockError`][flowlock.FlowlockError]; the store rolls back."""


@dataclass(frozen=True, slots=True)
class LockedResult:
    """What `apply_locked` saw and, when `plan` asked for a write, the committed instance;
    how long it waited for the lock and held it (seconds), when the store measures them."""

    snapshot: Snapshot
    committed: Instance | None
    waited: float | None = None
    held: float | None = None


@runtime_checkable
class Store(Protocol):
    """Persistence for instances and their history."""

    async def open(self) -> None:
        """Connect (and migrate, when configured to). Idempotent."""

    async def aclose(self) -> None:
        """Release every connection. Idempotent."""

    async def migrate(self) -> list[str]:
        """Apply pending schema migrations; returns the names applied now."""

    async def create(
        self,
        instance: Instance,
        request_id: str | None = None,
        arm: Sequence[Timing] = (),
        claims: Sequence[Claim] = (),
    ) -> Instance:
        """Insert a new instance at version 1 (stay 1), arming `arm`'s timers in the same
        transaction. Raises InstanceExists.

        `request_id`: the create's idempotency key, recorded with the state and data the
        instance starts with, in the same transaction as the insert (a key names one instance,
        an instance has at most one key). When the key was recorded before (also by a
        concurrent create that commits while this one waits), nothing is written and the
        instance as that first create made it is returned: version 1, its first state and data,
        `last_event` None, `updated_at` equal to `created_at`, however far it has moved since.
        The caller compares it with what it asked for; InstanceExists only when the id is taken
        and the key was never recorded.

        `claims`: what the new instance takes of its workflow's constraints, applied in the same
        transaction (see [`flowlock.stores.constraint_store`][flowlock.stores.constraint_store]);
        a refused one raises its error (version 1) and nothing is written. A create answered
        from its key applies none."""

    async def create_request(self, instance_id: str) -> tuple[str, Instance] | None:
        """The request id of the create that made the instance and the instance as it made it
        (as `create` answers a retry), or None when it was created without one (or does not
        exist). A read for `flowlock check`."""

    async def get(self, instance_id: str) -> Instance:
        """The instance as committed. Raises InstanceNotFound."""

    async def read(self, instance_id: str, request_ids: Sequence[str]) -> Snapshot:
        """An unlocked, consistent read of the instance and the entries found for
        `request_ids` (`Snapshot.priors`, by request id; none asked: empty)."""

    async def commit(self, entries: Sequence[HistoryEntry]) -> Instance | None:
        """Compare-and-swap: move the instance to the last entry if it is still at the first
        entry's `version - 1` and every request id is new, appending the entries in the same
        transaction (see [`entries_of`][flowlock.stores.base.entries_of] for what a batch must be).
        Returns the committed instance (as the last entry left it), or None when another writer got
        there first (version moved, a newer fencing token was written, or one of the request ids was
        applied meanwhile); then nothing is written."""

    async def commit_many(
        self, batches: Sequence[Sequence[HistoryEntry]]
    ) -> list[Instance | ConstraintRefused | None]:
        """`commit` for each batch, one instance each (no instance twice), in one round trip
        where the store can. Each compare-and-swap stands alone: one that loses (None at its
        place in the answer) writes nothing and leaves the others to commit. So does a batch
        whose claims a constraint refuses: its ConstraintRefused (CapacityReached,
        UniqueViolation, RateLimited; `version` and `event` of the entry refused) is its
        answer, not raised."""

    async def apply_locked(
        self, instance_id: str, request_ids: Sequence[str], plan: Plan, lock: RowLock
    ) -> LockedResult:
        """Lock the instance's row (bounded by `lock`), read it and the entries of
        `request_ids` (as `read`), run `plan`, write what it returns with one version
        compare-and-swap, commit. Raises LockTimeout /
        LockBusy, InstanceNotFound, or whatever `plan` raised (after rolling back)."""

    async def history(
        self, instance_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[HistoryEntry]:
        """The applied transitions of versions above `after`, oldest first, at most `limit`
        (None: all). Read as a range of the history's key, not the whole history then cut:
        a page deep in a long history costs what the page holds."""

    async def fencing_floor(self, instance_id: str) -> int:
        """The highest fencing token written for the instance (0 if none): a lock backend that
        lost its own counter (a Redis restart) floors new tokens on it."""

    async def list_instances(
        self, query: InstanceQuery, *, after: str | None, limit: int
    ) -> list[Instance]:
        """At most `limit` instances matching `query` whose id comes after `after` (None:
        from the first), ordered by id in code point order (byte order of the UTF-8, whatever the
        database's collation). One consistent read."""

    async def count_instances(self, query: InstanceQuery) -> int:
        """How many instances match `query`. One consistent read."""


@runtime_checkable
class PauseStore(Protocol):
    """Where whole workflows are paused: one row per paused workflow (every store is one).

    Every read that feeds a decision (`read`, `apply_locked`, and `get`, `list_instances`) sets
    `Instance.workflow_paused` from it, in the same consistent read as the instance, so a
    `fire` after `pause_workflow` returned is refused on every engine."""

    async def pause_workflow(self, workflow: str, reason: str, actor: str | None) -> WorkflowPause:
        """Pause `workflow` (the row's `at` on the store's clock) and return the pause; when it
        is paused already, the pause in place, unchanged."""
        ...

    async def resume_workflow(self, workflow: str) -> WorkflowPause | None:
        """Lift the pause of `workflow` and return it; None when it was not paused."""
        ...

    async def workflow_pauses(self) -> list[WorkflowPause]:
        """Every paused workflow, by name."""
        ...


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


@runtime_checkable
class EscalationBoard(Protocol):
    """Where engines share the adaptive strategy's escalations (so a fleet escalates together).
    The memory and PostgreSQL stores are boards; the engine syncs with its store when it is one.

    Every `until` on a board is counted on the board's own clock
    ([`now`][flowlock.stores.base.EscalationBoard.now]), never on the wall clock of the host that
    decided it: hosts whose clocks disagree, or one whose clock is changed by an hour, still agree
    on when an escalation ends."""

    async def publish(self, escalation: Escalation) -> None:
        """Record (or extend) an escalation."""
        ...

    async def active(self, now: float) -> list[Escalation]:
        """Every escalation whose `until` is after `now` (on the board's clock)."""
        ...

    async def now(self) -> float:
        """The board's clock, in seconds: the time every `until` on it is counted in."""
        ...


@runtime_checkable
class TransactionalStore(Protocol):
    """A store whose statements can run inside a transaction the caller opened, on the caller's
    connection, so the caller's own writes and a transition commit or roll back together."""

    def in_transaction(self, connection: object) -> AbstractAsyncContextManager[Store]:
        """This store on `connection` for the length of the `async with`: nothing is
        committed (the caller commits or rolls back), and an error inside undoes the store's part
        only, leaving the caller's transaction usable. InvalidInput when `connection` is not a
        connection of this store's kind inside an open transaction."""
        ...


class ArmedSignal(asyncio.Event):
    """What `TimerStore.armed()` yields: set when a commit armed a timer.

    A store that knows the new timer's due time calls `due_in(seconds)` instead of `set()`,
    so a service already waking sooner sleeps on (many arms, few wake-ups); `earliest` is the
    earliest such due time noticed since the last `clear()`, on the event loop's clock (None:
    unknown, so the service looks)."""

    def __init__(self) -> None:
        super().__init__()
        self.earliest: float | None = None
        self._unknown = False

    def due_in(self, seconds: float) -> None:
        """A timer due `seconds` from now was armed."""
        at = asyncio.get_running_loop().time() + max(0.0, seconds)
        if not self._unknown and (self.earliest is None or at < self.earliest):
            self.earliest = at
        super().set()

    def set(self) -> None:
        self._unknown = True
        self.earliest = None
        super().set()

    def clear(self) -> None:
        self.earliest = None
        self._unknown = False
        super().clear()


@runtime_checkable
class TimerStore(Protocol):
    """Durable timers, in the same database as the instances (every store is one).

    Timers are written by the commits of transitions, in their transaction: an entry that
    changes the state ends the old stay (`voids`: its timers are deleted) and arms the new one's
    (`arm`, due `after` seconds from the commit on the store's clock); an entry that fired a timer
    (`timer`) moves that timer on (a reminder with `every` and firings left) or deletes it. A
    create arms the initial state's timers (`create(..., arm=)`), with stay 1. The instance's
    `stay_version` is the version of the last entry that changed its state (1 until then).

    An engine's timer service claims due timers (one claimer each, for `lease` seconds), fires
    them through the engine, and sleeps until the next due time or until `armed()` is set."""

    async def claim_timers(
        self, workflows: Sequence[str], *, limit: int, lease: float, owner: str
    ) -> list[Timer]:
        """At most `limit` due timers of `workflows` that nobody holds (never claimed, or their
        claim ran out), earliest due first, each claimed by `owner` until `lease` seconds from
        now. Concurrent claimers never get the same timer (PostgreSQL: SKIP LOCKED)."""
        ...

    async def release_timer(self, timer: Timer, owner: str) -> None:
        """Give back `owner`'s claim on `timer` (a firing failed for a reason that may pass):
        another round may claim it at once. Nothing if the claim is no longer `owner`'s."""
        ...

    async def cancel_timer(self, timer: Timer) -> bool:
        """End one firing of `timer` that applied nothing (a guard refused, the event is gone):
        as its commit would, move a reminder on or delete it. A compare-and-swap on the stay and
        firing number: False, with nothing changed, when the timer moved on or was voided."""
        ...

    async def drop_timer(self, timer: Timer) -> bool:
        """Delete `timer`'s row, a reminder with firings left too, but only while it is still
        at `timer`'s stay, event and firing number (a compare-and-swap): for a firing that is
        stale or was cancelled, whose timer must not fire again. True if it deleted the row;
        False, with nothing changed, when the timer moved on or was voided meanwhile."""
        ...

    async def next_due(self, workflows: Sequence[str]) -> float | None:
        """Seconds from now (the store's clock) until a timer of `workflows` can be claimed
        (0 when one can be now, counting claims that run out), or None when none is armed."""
        ...

    async def timers(self, instance_id: str) -> list[Timer]:
        """The instance's armed timers, earliest due first (none: empty)."""
        ...

    async def due_timers(self, *, within: float, limit: int) -> list[Timer]:
        """At most `limit` timers due within `within` seconds from now or overdue, earliest
        first, each with its `lag` (for `flowlock timers`)."""
        ...

    async def count_timers(self) -> int:
        """How many timers are armed."""
        ...

    def armed(self) -> AbstractAsyncContextManager[ArmedSignal]:
        """A signal set whenever a commit arms a timer (PostgreSQL: NOTIFY, also from other
        engines; memory and SQLite: this process), for the length of the `async with`, with
        the due time when known (`ArmedSignal.due_in`). The service clears it before each look
        at the next due time."""
        ...


@runtime_checkable
class OutboxStore(Protocol):
    """The transactional outbox, in the same database as the instances (every store is one).

    Messages are written by the commits of transitions, in their transaction: each entry's
    `emits` become rows keyed `<instance_id>:<version>:<n>` (n from 0), status pending, due at
    once, carrying the entry's fencing token and trace. A lost compare-and-swap writes none.

    An engine's dispatcher claims due messages (one claimer each, for `lease` seconds), runs
    their handlers and marks them done, or failed (due again later) or dead. Messages of one
    instance are delivered in order: one is claimable only while no earlier message of its
    instance (lower version, or same version and lower n) is still pending, or together with
    them in one run (see `claim_messages`); done and dead ones do not hold it back. Statuses
    stored are pending, done and dead; a pending message whose claim has not run out reads as
    running."""

    async def claim_messages(
        self, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[Message]:
        """For each kind, at most `kinds[kind]` runs, oldest due head first. A run is one
        instance's claimable head (pending, due, not held by a live claim, none earlier of its
        instance pending) and the pending messages of that instance right behind it, in
        (version, n) order, while they are of the same kind, due and not held: at most `run`
        messages in all, contiguous (it stops at the first that is not). Each is claimed by
        `owner` for `lease` seconds and its `attempts` counted up by one. Returned as claimed
        (status running, `lag` the seconds since its commit on the store's clock), each run's
        messages together and in order. `run=1`: the heads alone.

        Concurrent claimers never get the same message (PostgreSQL: SKIP LOCKED on the heads),
        and order holds: a later message is claimed only with, or after, every earlier pending
        message of its instance (nobody else can claim behind a head that is pending)."""
        ...

    async def finish_messages(self, keys: Sequence[str]) -> int:
        """Mark the messages of `keys` done (a handler returned), whoever holds them now; those
        not pending any more (done, dead, dropped) are left as they are. Returns how many were
        marked."""
        ...

    async def fail_message(
        self,
        message: Message,
        owner: str,
        error: str,
        retry_in: float | None,
        *,
        counted: bool = True,
    ) -> bool:
        """A delivery of `message` by `owner` failed with `error`: due again in `retry_in`
        seconds (claim cleared), or dead when `retry_in` is None. Only while `owner` still
        holds that attempt (same `attempts`): False, nothing changed, when the claim ran out and
        another took it over, or it is done. `counted=False`: the attempt is counted back
        down (a Then into a paused instance: waiting is not failing)."""
        ...

    async def release_message(self, message: Message, owner: str, *, begun: bool = True) -> None:
        """Give back `owner`'s claim on `message`: another may claim it at once. `begun=False`:
        its delivery never began (the engine is closing, or an earlier message of its run
        failed), so its attempt is counted back down; a message behind a failing one must not
        run out of attempts without ever being tried. Nothing if the claim (that attempt) is no
        longer `owner`'s."""
        ...

    async def next_message_due(self, kinds: Sequence[str]) -> float | None:
        """Seconds from now (the store's clock) until a pending message of `kinds` is due or its
        claim runs out (0 when one is due now), or None when none of them is pending."""
        ...

    async def messages(self, instance_id: str) -> list[Message]:
        """The instance's messages in order (version, then n); none: empty."""
        ...

    async def find_messages(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        """At most `limit` messages (of `status` and `kind` when given; status "running" means
        pending and held), ordered by instance id in code point order, then version and place,
        after the message of key `after` (after every message of the instance `after` when it is
        not a key; None: from the first). For `flowlock outbox list`."""
        ...

    async def get_message(self, key: str) -> Message | None:
        """The message of `key`, or None."""
        ...

    async def retry_message(self, key: str) -> Message | None:
        """Make a dead (or pending) message due now, unclaimed, its attempts back to 0 (its last
        error kept). None when there is no such message. A done message, and one held by a live
        claim (running: a delivery is in flight), is left as it is and returned (the caller
        refuses it)."""
        ...

    async def drop_message(self, key: str) -> bool:
        """Delete the message of `key` (an operator gives up on it); later messages of its
        instance may then go. False when there was none."""
        ...

    async def count_messages(self) -> Mapping[str, int]:
        """How many messages there are per status (pending, running, done, dead; all present)."""
        ...

    async def purge_messages(self, older_than: float, limit: int) -> int:
        """Delete at most `limit` done messages done more than `older_than` seconds ago (on the
        store's clock), oldest first. Returns how many; the caller repeats while it gets
        `limit`."""
        ...

    def pending(self) -> AbstractAsyncContextManager[asyncio.Event]:
        """An event set whenever a commit writes a message (PostgreSQL: NOTIFY, also from other
        engines; memory and SQLite: this process), and when a notification may have been missed
        (a LISTEN connection opened again), for the length of the `async with`. The dispatcher
        clears it before each look."""
        ...


BeforeCommit = Callable[[Sequence[str]], None]
"""Run by `RetentionStore.purge_batch` inside its transaction, after the deletes and before the
commit, with the ids deleted: the archive is written and flushed there. Raising rolls back."""


@runtime_checkable
class RetentionStore(Protocol):
    """Legal holds, and the purge and restore of whole instances (every store is one).

    A purge reads candidates (`purge_candidates`, unlocked), then deletes them in short
    transactions (`purge_batch`), each delete a compare-and-swap on the version read: an
    instance that moved since, or was held meanwhile, is kept. A restore inserts archived
    instances verbatim (`restore_instances`)."""

    async def place_hold(self, hold: Hold) -> Hold:
        """Record `hold` (its `at` is the store's now) unless the instance is held already;
        returns the hold that stands (the earlier one, when there was one), its
        `instance_found` telling whether the instance existed once the hold was in place. A
        purge batch running meanwhile either sees the hold or has deleted the instance first."""
        ...

    async def lift_hold(self, instance_id: str) -> bool:
        """Lift the instance's hold; False when there was none."""
        ...

    async def find_holds(self, *, after: str | None, limit: int) -> list[Hold]:
        """At most `limit` holds whose instance id comes after `after` (None: from the
        first), in code point order of the id."""
        ...

    async def purge_candidates(
        self, selection: PurgeSelection, *, after: str | None, limit: int
    ) -> list[ArchivedInstance]:
        """At most `limit` instances `selection` takes now (the age on the store's clock; not
        held; no outbox message pending), id after `after`, in code point order, each with
        its history (up to its version), fencing token and create record."""
        ...

    async def count_purgeable(self, selection: PurgeSelection) -> tuple[int, int]:
        """How many instances `selection` takes now, and how many more it would take but for
        their holds. One consistent read."""
        ...

    async def purge_batch(
        self, victims: Sequence[tuple[str, int]], before_commit: BeforeCommit | None = None
    ) -> list[str]:
        """In one short transaction, delete each (instance id, version) whose instance is
        still at that version, not held and without a pending outbox message, with its history,
        timers, outbox messages and create record; `before_commit(deleted ids)` runs before the
        commit (an error there rolls everything back and is raised). Returns the ids deleted,
        in code point order. A row lock held by a writer is waited for (bounded by the store's
        lock timeout): the compare-and-swap then sees what it committed."""
        ...

    async def restore_instances(self, archived: Sequence[ArchivedInstance]) -> list[str]:
        """Insert each archived instance, its history and its create record verbatim, in one
        transaction; an id that exists is skipped (and so is its history). Returns the ids
        inserted."""
        ...
