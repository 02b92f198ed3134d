"""The SQLite store's outbox methods (a mixin of
[`SqliteStore`][flowlock.stores.sqlite.SqliteStore]): the
[`OutboxStore`][flowlock.stores.base.OutboxStore] port over the transactions of `outbox_sql`.

Commits write the messages (`txn._write_batch`); these methods read, claim and repair them.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from flowlock.core.outbox import Message
from flowlock.stores.sqlite.outbox_sql import (
    any_claimable_txn,
    claim_txn,
    count_txn,
    drop_txn,
    fail_txn,
    find_txn,
    finish_txn,
    get_txn,
    messages_txn,
    next_due_txn,
    purge_txn,
    release_txn,
    retry_txn,
)
from flowlock.stores.sqlite.part import StorePart
from flowlock.stores.sqlite.txn import Wake

__all__ = ["SqliteOutbox"]


class _Poll:
    """Sets `event` every `interval` seconds until stopped: the fallback that finds messages
    another process committed (its commits cannot set this process's events). A loop timer,
    not a task, so stopping it is synchronous and leaves nothing to await."""

    def __init__(self, event: asyncio.Event, interval: float) -> None:
        self._event = event
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(interval, self._tick)

    def _tick(self) -> None:
        self._event.set()
        self._handle = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> None:
        self._handle.cancel()


class SqliteOutbox(StorePart):
    """SqliteStore's part as an OutboxStore. Writes go through the store's write queue and
    SQLite's write lock; reads run on any free connection, beside a writer (WAL)."""

    outbox_poll: float
    _pending_events: set[asyncio.Event]

    def _init_outbox(self) -> None:
        self._pending_events = set()

    def _wake_outbox(self) -> None:
        for event in self._pending_events:
            event.set()

    async def claim_messages(
        self, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[Message]:
        """For each kind, at most its limit of runs (a claimable head, oldest due first, and the
        messages right behind it that may go with it, `run` in all at most), claimed by
        `owner` for `lease` seconds in one write transaction (no two claimers get one
        message: SQLite runs one writer at a time)."""
        wanted = {kind: limit for kind, limit in kinds.items() if limit > 0}
        if not wanted:
            self._live()
            return []
        # A read first: the write lock is taken only when something can be claimed.
        if not await self._read(any_claimable_txn, tuple(wanted), what="claim_messages"):
            return []
        return await self._write_now(
            self.path,  # SQLite's write lock is the whole database's
            lambda conn, _: claim_txn(conn, wanted, lease, owner, run),
            "claim_messages",
        )

    async def finish_messages(self, keys: Sequence[str]) -> int:
        """Mark the pending messages of `keys` done, whoever holds them; how many were."""
        chosen = tuple(keys)
        if not chosen:
            self._live()
            return 0
        return await self._write_now(
            chosen[0], lambda conn, _: finish_txn(conn, chosen), "finish_messages"
        )

    async def fail_message(
        self,
        message: Message,
        owner: str,
        error: str,
        retry_in: float | None,
        *,
        counted: bool = True,
    ) -> bool:
        """`owner`'s delivery of `message` failed: due again in `retry_in` seconds, or dead
        (None); its attempt counted back down unless `counted`. False, nothing changed, when
        `owner` no longer holds that attempt."""

        def txn(conn: sqlite3.Connection, wake: Wake) -> bool:
            failed = fail_txn(conn, message, owner, error, retry_in, counted)
            wake.messages = failed and retry_in is not None
            return failed

        return await self._write_now(message.key, txn, "fail_message")

    async def release_message(self, message: Message, owner: str, *, begun: bool = True) -> None:
        """Give back `owner`'s claim on `message` (nothing if the claim is not `owner`'s); its
        attempt counted back down when its delivery never began (`begun=False`)."""

        def txn(conn: sqlite3.Connection, wake: Wake) -> bool:
            wake.messages = release_txn(conn, message, owner, begun)
            return wake.messages

        await self._write_now(message.key, txn, "release_message")

    async def next_message_due(self, kinds: Sequence[str]) -> float | None:
        """Seconds until a pending message of `kinds` is due or its claim runs out (0: now),
        None when none is pending."""
        names = tuple(dict.fromkeys(kinds))
        if not names:
            self._live()
            return None
        return await self._read(next_due_txn, names, what="next_message_due")

    async def messages(self, instance_id: str) -> list[Message]:
        """The instance's messages in order (version, then n)."""
        return await self._read(messages_txn, instance_id, what="messages")

    async def find_messages(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        """At most `limit` messages in message order after `after`, of `status` and `kind`."""
        return await self._read(find_txn, status, kind, after, limit, what="find_messages")

    async def get_message(self, key: str) -> Message | None:
        """The message of `key`, or None."""
        return await self._read(get_txn, key, what="get_message")

    async def retry_message(self, key: str) -> Message | None:
        """Make a dead (or pending) message due now, unclaimed, attempts 0; a done one is
        returned as it is. None when there is none."""

        def txn(conn: sqlite3.Connection, wake: Wake) -> Message | None:
            found, wake.messages = retry_txn(conn, key)
            return found

        return await self._write_now(key, txn, "retry_message")

    async def drop_message(self, key: str) -> bool:
        """Delete the message of `key`; False when there was none."""

        def txn(conn: sqlite3.Connection, wake: Wake) -> bool:
            # A later message of its instance may go now.
            wake.messages = drop_txn(conn, key)
            return wake.messages

        return await self._write_now(key, txn, "drop_message")

    async def count_messages(self) -> Mapping[str, int]:
        """How many messages there are per status (pending, running, done, dead)."""
        return await self._read(count_txn, what="count_messages")

    async def purge_messages(self, older_than: float, limit: int) -> int:
        """Delete at most `limit` done messages done more than `older_than` seconds ago, oldest
        first; how many."""
        return await self._write_now(
            self.path, lambda conn, _: purge_txn(conn, older_than, limit), "purge_messages"
        )

    @asynccontextmanager
    async def pending(self) -> AsyncIterator[asyncio.Event]:
        """An event set when a commit of this store object writes a message, when a message is
        retried, dropped or fails to be tried again later, and every `outbox_poll` seconds:
        another process's commits cannot set it, so that is how long their messages may wait
        for a dispatcher here that is idle."""
        event = asyncio.Event()
        poll = _Poll(event, self.outbox_poll)
        self._pending_events.add(event)
        try:
            yield event
        finally:
            self._pending_events.discard(event)
            poll.stop()
