"""The engine's outbox methods: read and repair messages (a mixin of `flowlock.Engine`)."""

from __future__ import annotations

from flowlock._calls import check_text
from flowlock.core.errors import InvalidInput, MessageNotFound
from flowlock.core.outbox import MESSAGE_STATUSES, Message, check_kind, parse_key
from flowlock.core.settings import check_count
from flowlock.stores.base import OutboxStore, Store

__all__ = ["MAX_PAGE", "OutboxMethods"]

MAX_PAGE = 10_000
"""The most messages one `find_messages` call returns."""


class OutboxMethods:
    """`flowlock.Engine`'s outbox reads and repairs; the engine is `self`."""

    _store: Store

    def _check_open(self) -> None: ...  # the engine's

    def _outbox_store(self) -> OutboxStore:
        store = self._store
        if not isinstance(store, OutboxStore):
            raise InvalidInput(f"the store {type(store).__name__} keeps no outbox")
        return store

    async def messages(self, instance_id: str) -> list[Message]:
        """The instance's outbox messages in the order they were emitted: kind, key, status
        (pending / running / done / dead), attempts, last error, next attempt. Empty when it
        emitted none (or does not exist)."""
        self._check_open()
        check_text(instance_id, "instance_id")
        return await self._outbox_store().messages(instance_id)

    async def find_messages(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        """At most `limit` messages of any instance, in key order after the key `after`, of
        `status` and `kind` when given (what `flowlock outbox list` shows)."""
        self._check_open()
        if status is not None and status not in MESSAGE_STATUSES:
            raise InvalidInput(f"status {status!r} is not one of {MESSAGE_STATUSES}")
        if kind is not None:
            check_kind(kind)
        if after is not None:
            check_text(after, "after")
        check_count("limit", limit, most=MAX_PAGE, unit="messages")
        store = self._outbox_store()
        return await store.find_messages(status=status, kind=kind, after=after, limit=limit)

    async def message(self, key: str) -> Message:
        """The message of `key`. Raises MessageNotFound."""
        self._check_open()
        parse_key(key)
        found = await self._outbox_store().get_message(key)
        if found is None:
            raise MessageNotFound(key)
        return found

    async def retry_message(self, key: str) -> Message:
        """Deliver a dead (or waiting) message again now, with a fresh count of attempts.
        Raises MessageNotFound, or InvalidInput for a message already done (nothing changed)."""
        self._check_open()
        parse_key(key)
        found = await self._outbox_store().retry_message(key)
        if found is None:
            raise MessageNotFound(key)
        if found.status == "done":
            raise InvalidInput(
                f"message {key!r} was delivered already (done); a done message is never sent again"
            )
        return found

    async def drop_message(self, key: str) -> None:
        """Delete a message that will not be delivered (an operator gives up on it); later
        messages of its instance may then go. Raises MessageNotFound."""
        self._check_open()
        parse_key(key)
        if not await self._outbox_store().drop_message(key):
            raise MessageNotFound(key)
