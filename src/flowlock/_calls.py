"""What the engine checks of a call before any I/O, and how a create reaches a store."""

from __future__ import annotations

import re
from collections.abc import Sequence

from flowlock.core.constraints import Claim
from flowlock.core.errors import CreateKeyReused, InvalidInput
from flowlock.core.jsondata import same_json
from flowlock.core.models import RESERVED_EVENTS, TIMER_PREFIX, Instance, Timing
from flowlock.core.settings import check_text as _text
from flowlock.stores.base import Store, TransactionalStore

__all__ = [
    "MAX_ID_LENGTH",
    "check_fire_args",
    "check_text",
    "create_with",
    "first_create",
    "transactional",
]

MAX_ID_LENGTH = 200
# A request id flowlock makes may be longer than a caller's: a message key is the instance id
# (up to MAX_ID_LENGTH) and ":<version>:<n>", two numbers of at most 20 digits.
_MAX_OWN_ID = MAX_ID_LENGTH + 42
_KEY_TAIL = re.compile(r":[0-9]+:[0-9]+")
_EVENT = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}")


def check_text(value: object, what: str) -> str:
    return _text(what, value, most=MAX_ID_LENGTH)


def check_fire_args(
    instance_id: str,
    event: str,
    actor: str | None,
    request_id: str | None,
    expected_version: int | None,
    *,
    repair: bool = False,
) -> None:
    """Every argument of `fire` but the payload, checked before anything is read. `repair`:
    the event is one of the operator's reserved ones, which no caller of `fire` may send."""
    check_text(instance_id, "instance_id")
    if repair:
        assert event in RESERVED_EVENTS
    elif not isinstance(event, str) or not _EVENT.fullmatch(event):
        raise InvalidInput(
            f"event {event!r} is not a valid event name (a letter, then letters, digits, "
            "'_', '.', '-'; at most 100 characters)"
        )
    if actor is not None:
        check_text(actor, "actor")
    if request_id is not None:
        _text("request_id", request_id, most=_MAX_OWN_ID)
    if expected_version is not None and (
        isinstance(expected_version, bool)
        or not isinstance(expected_version, int)
        or expected_version < 1
    ):
        raise InvalidInput(f"expected_version must be a positive integer, not {expected_version!r}")


async def create_with(
    store: Store,
    new: Instance,
    request_id: str | None,
    arm: Sequence[Timing],
    claims: Sequence[Claim] = (),
) -> Instance:
    # Without a key, timers or claims, a store written before them (create(instance)) works.
    if claims:
        return await store.create(new, request_id, arm, claims)
    if arm:
        return await store.create(new, request_id, arm)
    return await (store.create(new) if request_id is None else store.create(new, request_id))


def first_create(asked: Instance, made: Instance, request_id: str | None) -> Instance:
    """`made`, what the store answered a create under `request_id`, once it is known to answer
    the create `asked` for; CreateKeyReused when the key's first create was another one."""
    if request_id is not None and (
        made.id != asked.id
        or made.workflow != asked.workflow
        or not same_json(made.data, asked.data)
    ):
        raise CreateKeyReused(
            request_id,
            original_instance_id=made.id,
            instance_id=asked.id,
            original_workflow=made.workflow,
            workflow=asked.workflow,
            original_data=made.data,
            data=asked.data,
        )
    return made


def transactional(store: Store) -> TransactionalStore:
    """`store`, when it can join a caller's transaction (`connection=`)."""
    if not isinstance(store, TransactionalStore):
        raise InvalidInput(
            "connection= runs flowlock inside a transaction you opened on PostgreSQL; this "
            f"engine's store ({type(store).__name__}) cannot join one. Use an engine on a "
            "postgresql:// database, or call without connection=. Nothing was read or written"
        )
    return store


def caller_request_id(request_id: str | None, instance_id: str) -> str | None:
    """A caller's `request_id`, refused when it takes the form of a timer's firing or of a
    message key of the instance (`<instance_id>:<version>:<n>`): those ids are flowlock's own
    (a timer's firing, a handler's Then), and a caller using one would make theirs a replay."""
    if not isinstance(request_id, str):
        return request_id
    check_text(request_id, "request_id")
    if request_id.startswith(TIMER_PREFIX):
        raise InvalidInput(
            f"request_id {request_id!r} starts with {TIMER_PREFIX!r}, which flowlock keeps for "
            "the firings of timers; choose another request id. Nothing was read or written"
        )
    tail = request_id[len(instance_id) :] if isinstance(instance_id, str) else ""
    if request_id.startswith(f"{instance_id}:") and _KEY_TAIL.fullmatch(tail):
        raise InvalidInput(
            f"request_id {request_id!r} has the form of an outbox message key of instance "
            f"{instance_id!r} ('<instance_id>:<version>:<n>'), which flowlock keeps for the Then "
            "of that message's handler; choose another request id. Nothing was read or written"
        )
    return request_id
