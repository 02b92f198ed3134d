"""The memory store's outbox: the [`OutboxStore`][flowlock.stores.base.OutboxStore] methods on
dicts, due and claimed on the process's monotonic clock (a mixin of MemoryStore)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import Message, MessageStatus, key_cursor, message_key

__all__ = ["MemoryOutbox", "copy_json", "wall"]


def copy_json(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` round-tripped through JSON, as a database would store it."""
    out: dict[str, Any] = json.loads(json.dumps(data))
    return out


def wall(monotonic: float) -> datetime:
    """A time on the monotonic clock as the wall-clock time it falls at (for display)."""
    return datetime.now(UTC) + timedelta(seconds=monotonic - time.monotonic())


@dataclasses.dataclass(slots=True)
class _Held:
    """A message as the memory store keeps it: due, claimed and done on the monotonic clock."""

    message: Message
    created: float
    due: float
    claimed_until: float | None = None
    owner: str | None = None
    done: float | None = None


def _order(held: _Held) -> tuple[str, int, int]:
    m = held.message
    return m.instance_id, m.version, m.n


class MemoryOutbox:
    """MemoryStore's part as an OutboxStore (the store calls `_write_messages` in its commit)."""

    _outbox: dict[str, _Held]
    _pending_events: set[asyncio.Event]

    def _check(self) -> None: ...  # the store's

    def _init_outbox(self) -> None:
        self._outbox = {}
        self._pending_events = set()

    def _write_messages(self, new: Instance, rows: Sequence[HistoryEntry]) -> None:
        """The messages of a committed batch's entries, pending and due now."""
        now = time.monotonic()
        wrote = False
        for row in rows:
            for n, emit in enumerate(row.emits):
                key = message_key(new.id, row.version, n)
                message = Message(
                    key=key,
                    instance_id=new.id,
                    workflow=new.workflow,
                    version=row.version,
                    n=n,
                    kind=emit.kind,
                    payload=copy_json(emit.payload),
                    fencing_token=row.fencing_token,
                    created_at=wall(now),
                    next_attempt_at=wall(now),
                    trace=row.trace,
                )
                self._outbox[key] = _Held(message, now, now)
                wrote = True
        if wrote:
            for event in self._pending_events:
                event.set()

    def _shown_message(self, held: _Held, now: float) -> Message:
        claimed = held.claimed_until is not None and held.claimed_until > now
        status = held.message.status
        return dataclasses.replace(
            held.message,
            payload=copy_json(held.message.payload),
            status="running" if status == "pending" and claimed else status,
            next_attempt_at=wall(held.due) if status == "pending" else None,
            claimed_until=wall(held.claimed_until) if claimed and held.claimed_until else None,
            done_at=None if held.done is None else wall(held.done),
        )

    def _pending_by_instance(self) -> dict[str, list[_Held]]:
        """Each instance's pending messages in (version, n) order: the first is its head."""
        queues: dict[str, list[_Held]] = {}
        for held in sorted(self._outbox.values(), key=_order):
            if held.message.status == "pending":
                queues.setdefault(held.message.instance_id, []).append(held)
        return queues

    def _pending_instances(self) -> set[str]:
        """The ids of the instances with a message still to deliver (retention keeps them)."""
        return {
            h.message.instance_id for h in self._outbox.values() if h.message.status == "pending"
        }

    def _drop_messages(self, instance_id: str) -> None:
        """Delete every message of the instance (it is being purged)."""
        for key in [k for k, h in self._outbox.items() if h.message.instance_id == instance_id]:
            del self._outbox[key]

    async def claim_messages(
        self, kinds: Mapping[str, int], *, lease: float, owner: str, run: int = 1
    ) -> list[Message]:
        self._check()
        now = time.monotonic()
        queues = self._pending_by_instance()

        def free(h: _Held, kind: str) -> bool:
            return (
                h.message.kind == kind
                and h.due <= now
                and (h.claimed_until is None or h.claimed_until <= now)
            )

        claimed: list[Message] = []
        for kind, limit in kinds.items():
            heads = [q for q in queues.values() if free(q[0], kind)]
            heads.sort(key=lambda q: (q[0].due, _order(q[0])))
            for queue in heads[: max(0, limit)]:
                taken = [queue[0]]
                for held in queue[1 : max(1, run)]:
                    if not free(held, kind):
                        break  # contiguous: a run stops at the first it may not take
                    taken.append(held)
                for held in taken:
                    held.claimed_until, held.owner = now + lease, owner
                    attempts = held.message.attempts + 1
                    held.message = dataclasses.replace(held.message, attempts=attempts)
                    shown = self._shown_message(held, now)
                    claimed.append(dataclasses.replace(shown, lag=max(0.0, now - held.created)))
        return claimed

    async def finish_messages(self, keys: Sequence[str]) -> int:
        self._check()
        now, marked = time.monotonic(), 0
        for key in keys:
            held = self._outbox.get(key)
            if held is not None and held.message.status == "pending":
                attempts = max(held.message.attempts, 1)  # delivered at least once
                held.message = dataclasses.replace(held.message, status="done", attempts=attempts)
                held.done, held.claimed_until, held.owner = now, None, None
                marked += 1
        return marked

    def _held_by(self, message: Message, owner: str) -> _Held | None:
        held = self._outbox.get(message.key)
        if (
            held is None
            or held.message.status != "pending"
            or held.owner != owner
            or held.message.attempts != message.attempts
        ):
            return None
        return held

    async def fail_message(
        self,
        message: Message,
        owner: str,
        error: str,
        retry_in: float | None,
        *,
        counted: bool = True,
    ) -> bool:
        self._check()
        held = self._held_by(message, owner)
        if held is None:
            return False
        status: MessageStatus = "dead" if retry_in is None else "pending"
        attempts = held.message.attempts if counted else max(0, held.message.attempts - 1)
        held.message = dataclasses.replace(
            held.message, status=status, last_error=error, attempts=attempts
        )
        held.claimed_until = held.owner = None
        if retry_in is not None:
            held.due = time.monotonic() + max(0.0, retry_in)
            self._wake()
        return True

    async def release_message(self, message: Message, owner: str, *, begun: bool = True) -> None:
        self._check()
        held = self._held_by(message, owner)
        if held is not None:
            held.claimed_until = held.owner = None
            if not begun:
                attempts = max(0, held.message.attempts - 1)
                held.message = dataclasses.replace(held.message, attempts=attempts)
            self._wake()

    async def next_message_due(self, kinds: Sequence[str]) -> float | None:
        self._check()
        now = time.monotonic()
        wanted = set(kinds)
        times = [
            max(h.due, h.claimed_until or h.due)
            for h in self._outbox.values()
            if h.message.status == "pending" and h.message.kind in wanted
        ]
        return None if not times else max(0.0, min(times) - now)

    async def messages(self, instance_id: str) -> list[Message]:
        self._check()
        now = time.monotonic()
        own = [h for h in self._outbox.values() if h.message.instance_id == instance_id]
        return [self._shown_message(h, now) for h in sorted(own, key=_order)]

    async def find_messages(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Message]:
        self._check()
        now = time.monotonic()
        cursor = key_cursor(after)
        found: list[Message] = []
        for held in sorted(self._outbox.values(), key=_order):
            if _order(held) <= cursor:
                continue
            shown = self._shown_message(held, now)
            if (status is None or shown.status == status) and (kind is None or shown.kind == kind):
                found.append(shown)
                if len(found) >= limit:
                    break
        return found

    async def get_message(self, key: str) -> Message | None:
        self._check()
        held = self._outbox.get(key)
        return None if held is None else self._shown_message(held, time.monotonic())

    async def retry_message(self, key: str) -> Message | None:
        self._check()
        held = self._outbox.get(key)
        if held is None:
            return None
        now = time.monotonic()
        live = held.claimed_until is not None and held.claimed_until > now
        if held.message.status != "done" and not live:
            held.message = dataclasses.replace(held.message, status="pending", attempts=0)
            held.due, held.claimed_until, held.owner = now, None, None
            self._wake()
        return self._shown_message(held, now)

    async def drop_message(self, key: str) -> bool:
        self._check()
        dropped = self._outbox.pop(key, None) is not None
        if dropped:
            self._wake()  # a later message of its instance may go now
        return dropped

    async def count_messages(self) -> Mapping[str, int]:
        self._check()
        now = time.monotonic()
        counts = dict.fromkeys(("pending", "running", "done", "dead"), 0)
        for held in self._outbox.values():
            counts[self._shown_message(held, now).status] += 1
        return counts

    async def purge_messages(self, older_than: float, limit: int) -> int:
        self._check()
        cutoff = time.monotonic() - older_than
        old = [h for h in self._outbox.values() if h.done is not None and h.done < cutoff]
        old.sort(key=lambda h: h.done or 0.0)
        for held in old[:limit]:
            del self._outbox[held.message.key]
        return min(len(old), limit)

    def _wake(self) -> None:
        for event in self._pending_events:
            event.set()

    @asynccontextmanager
    async def pending(self) -> AsyncIterator[asyncio.Event]:
        event = asyncio.Event()
        self._pending_events.add(event)
        try:
            yield event
        finally:
            self._pending_events.discard(event)
