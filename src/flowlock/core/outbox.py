"""The outbox's values: what a transition emits (`Emit`), what a handler receives (`Message`)
and what it may answer (`Then`). Pure values, no I/O.

A message is written in the same transaction as the transition that emitted it, under the key
`<instance_id>:<version>:<n>`: the history entry's version and the message's place (from 0)
among the entry's messages. The key is stable across retries and unique forever.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeAlias

from flowlock.core.errors import InvalidInput

__all__ = [
    "MESSAGE_STATUSES",
    "OUTBOX_ACTOR",
    "Emit",
    "Message",
    "MessageStatus",
    "Then",
    "check_kind",
    "key_cursor",
    "message_key",
    "parse_key",
]

MessageStatus: TypeAlias = Literal["pending", "running", "done", "dead"]
"""Where a message is: waiting to be delivered (or to be tried again), being delivered now (a
dispatcher holds its claim), delivered, or given up after `max_attempts` (kept until retried or
dropped by hand)."""
MESSAGE_STATUSES: tuple[str, ...] = ("pending", "running", "done", "dead")

OUTBOX_ACTOR = "flowlock:outbox"
"""The `actor` of a transition a handler's `Then` fired, unless the Then names one."""

_EVENT = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}")
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_.\-:]{0,99}")


def check_kind(kind: object, what: str = "message kind") -> str:
    """`kind` if it is a valid message kind, else InvalidInput saying what is wrong."""
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise InvalidInput(
            f"{what} {kind!r} must start with a letter and use only letters, digits, '_', '.', "
            "'-', ':' (at most 100 characters)"
        )
    return kind


@dataclass(frozen=True, slots=True)
class Emit:
    """A message a transition emits: `kind` names the handler (`engine.on_emit(kind, ...)`),
    `payload` is a JSON object (checked as data is, when the transition runs)."""

    kind: str
    payload: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_kind(self.kind)


@dataclass(frozen=True, slots=True)
class Then:
    """What a handler may return: fire `event` on the message's instance, with `payload` and
    `actor`, under the request id of the message's key. A redelivered message so never fires it
    twice."""

    event: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    actor: str | None = None

    def __post_init__(self) -> None:
        # Checked when made, so a handler's mistake shows in its own traceback; the payload's
        # JSON and the actor are checked as any call's when the Then is fired.
        if not isinstance(self.event, str) or not _EVENT.fullmatch(self.event):
            raise InvalidInput(
                f"Then event {self.event!r} is not a valid event name (a letter, then letters, "
                "digits, '_', '.', '-'; at most 100 characters)"
            )
        if not isinstance(self.payload, Mapping):
            raise InvalidInput(
                f"Then payload must be a JSON object (a mapping), not {type(self.payload).__name__}"
            )


def message_key(instance_id: str, version: int, n: int) -> str:
    """The key of message `n` (from 0) of the entry that took `instance_id` to `version`."""
    return f"{instance_id}:{version}:{n}"


def parse_key(key: str) -> tuple[str, int, int]:
    """`(instance_id, version, n)` of a message key, or InvalidInput. The instance id may hold
    ':' itself, so the key is split from the right."""
    if isinstance(key, str):
        head, sep, tail = key.rpartition(":")
        inst, sep2, version = head.rpartition(":")
        if sep and sep2 and inst and version.isdigit() and tail.isdigit():
            return inst, int(version), int(tail)
    raise InvalidInput(
        f"message key {key!r} is not '<instance_id>:<version>:<n>' (as engine.messages() lists)"
    )


def key_cursor(after: str | None) -> tuple[str, int, int]:
    """Where a listing in message order (instance id in code point order, version, place)
    resumes after the key `after`: its three parts; before every message for None; after every
    message of the instance `after` when it is not a key."""
    if after is None:
        return "", 0, -1
    try:
        return parse_key(after)
    except InvalidInput:
        return after, 2**63 - 1, 2**31 - 1


@dataclass(frozen=True, slots=True, init=False)
class Message:
    """One emitted message, as a handler receives it and `engine.messages()` lists it.

    - `key`: `<instance_id>:<version>:<n>`, the idempotency key to pass on (an HTTP header, a
      unique column): a redelivery carries the same one.
    - `version`: the version the emitting transition took the instance to; `n` its place.
    - `attempts`: deliveries begun so far, this one included (`attempt` in a handler).
    - `fencing_token`: the lease's token when the distributed strategy wrote the transition.
    - `status`: pending, running (a dispatcher holds it), done or dead.
    - `last_error`: why the last delivery failed; `next_attempt_at`: when it may run again.
    - `lag`: seconds from the commit to this delivery's claim (a handler's view; 0 elsewhere).

    Stores make messages; a test may too, to call a handler directly:
    `Message(key="o-1:2:0", instance_id="o-1", kind="notify", payload={...}, attempt=1)`
    (`version` and `n` are read from the key when not given; `attempt` is `attempts`).
    """

    key: str
    instance_id: str
    workflow: str
    version: int
    n: int
    kind: str
    payload: Mapping[str, Any]
    status: MessageStatus
    attempts: int
    fencing_token: int | None
    last_error: str | None
    next_attempt_at: datetime | None
    created_at: datetime | None
    done_at: datetime | None
    claimed_until: datetime | None
    trace: str | None = field(repr=False)
    lag: float = field(compare=False)

    def __init__(
        self,
        key: str,
        instance_id: str,
        workflow: str = "",
        version: int | None = None,
        n: int | None = None,
        kind: str = "",
        payload: Mapping[str, Any] | None = None,
        status: MessageStatus = "pending",
        attempts: int | None = None,
        fencing_token: int | None = None,
        last_error: str | None = None,
        next_attempt_at: datetime | None = None,
        created_at: datetime | None = None,
        done_at: datetime | None = None,
        claimed_until: datetime | None = None,
        trace: str | None = None,
        lag: float = 0.0,
        *,
        attempt: int | None = None,
    ) -> None:
        if version is None or n is None:
            try:
                _, read_version, read_n = parse_key(key)
            except InvalidInput:
                read_version = read_n = 0
            version = read_version if version is None else version
            n = read_n if n is None else n
        values = {
            "key": key,
            "instance_id": instance_id,
            "workflow": workflow,
            "version": version,
            "n": n,
            "kind": kind,
            "payload": {} if payload is None else payload,
            "status": status,
            "attempts": attempts if attempts is not None else (attempt or 0),
            "fencing_token": fencing_token,
            "last_error": last_error,
            "next_attempt_at": next_attempt_at,
            "created_at": created_at,
            "done_at": done_at,
            "claimed_until": claimed_until,
            "trace": trace,
            "lag": lag,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def attempt(self) -> int:
        """This delivery's number, from 1 (the same as `attempts` while a handler runs)."""
        return self.attempts
