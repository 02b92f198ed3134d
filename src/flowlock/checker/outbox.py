"""The outbox rules of the exactly-once check: every message belongs to a transition in the
history, under its own key; no message is done without a delivery; a `Then` fed back by a
message's handler comes after the transition that emitted it.

Pure, no I/O. A message is written by the commit of the transition that emitted it, keyed
`<instance_id>:<version>:<n>` (the version that transition made, its place from 0) and
carrying that transition's fencing token. A handler's `Then` fires under the request id of the
message's key. docs/checker.md and docs/outbox.md say more.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowlock.checker.verdicts import (
    EARLY_THEN,
    MESSAGE_KEY,
    ORPHAN_MESSAGE,
    UNDELIVERED_DONE,
    Violation,
)
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.outbox import Message, message_key

__all__ = ["check_messages"]


def check_messages(
    name: str,
    instance: Instance,
    ordered: Sequence[HistoryEntry],
    messages: Sequence[Message],
) -> list[Violation]:
    """Every outbox rule on one instance: `ordered` are its history rows in version order,
    `messages` its outbox messages (`engine.messages(id)`), read with it."""
    found: list[Violation] = []
    entries = {entry.version: entry for entry in ordered}
    own: dict[str, Message] = {}
    for message in messages:
        found.extend(_key(name, instance, message))
        if message.instance_id != instance.id:
            continue
        own[message.key] = message
        found.extend(_orphan(name, instance, message, entries.get(message.version)))
        found.extend(_undelivered(name, message))
    found.extend(_early_thens(name, ordered, own))
    return found


def _key(name: str, instance: Instance, message: Message) -> list[Violation]:
    """A message is delivered under its own key: `<instance_id>:<version>:<n>` of the
    transition that emitted it; a receiver drops duplicates by it."""
    if message.instance_id != instance.id:
        return [
            Violation(
                MESSAGE_KEY,
                f"{name}: its messages include {message.key!r} of instance {message.instance_id!r}",
                message.version,
            )
        ]
    expected = message_key(message.instance_id, message.version, message.n)
    if message.key == expected:
        return []
    return [
        Violation(
            MESSAGE_KEY,
            f"{name}: message {message.key!r} ({message.kind!r}) was emitted as message "
            f"{message.n} of version {message.version}, so its key must be {expected!r}: a "
            "receiver that drops duplicates by key would take its redeliveries for new messages",
            message.version,
        )
    ]


def _orphan(
    name: str, instance: Instance, message: Message, entry: HistoryEntry | None
) -> list[Violation]:
    """A message is written by the commit of the transition it belongs to: its version has a
    history row, and it carries that row's fencing token."""
    what = f"{name}: message {message.key!r} ({message.kind!r}, {message.status})"
    if entry is None:
        return [
            Violation(
                ORPHAN_MESSAGE,
                f"{what} was emitted at version {message.version}, but the history has no "
                f"transition at that version (the instance is at version {instance.version}): "
                "it was written without the transition that should have emitted it (a lost "
                "compare-and-swap or a rolled-back transaction that kept its messages)",
                message.version,
            )
        ]
    if message.fencing_token != entry.fencing_token:
        return [
            Violation(
                ORPHAN_MESSAGE,
                f"{what} carries the fencing token {message.fencing_token}, but the transition "
                f"at version {message.version} ({entry.event!r}) was written under "
                f"{entry.fencing_token}: another transaction than that transition's wrote it",
                message.version,
            )
        ]
    return []


def _undelivered(name: str, message: Message) -> list[Violation]:
    """A message is done only after a delivery began: at least one attempt."""
    if message.status != "done" or message.attempts > 0:
        return []
    return [
        Violation(
            UNDELIVERED_DONE,
            f"{name}: message {message.key!r} ({message.kind!r}) is done after 0 attempts: no "
            "handler was ever given it, so it was marked delivered without being delivered",
            message.version,
        )
    ]


def _early_thens(
    name: str, ordered: Sequence[HistoryEntry], own: dict[str, Message]
) -> list[Violation]:
    """A row fired under the request id of one of the instance's messages is that message's
    `Then`: it can only come after the transition that emitted the message. (Applied at most
    once is the request id rule, checked with every other request id.)"""
    found: list[Violation] = []
    for entry in ordered:
        message = None if entry.request_id is None else own.get(entry.request_id)
        if message is None or entry.version > message.version:
            continue
        found.append(
            Violation(
                EARLY_THEN,
                f"{name}: version {entry.version} ({entry.event!r}) was fired under the key of "
                f"message {message.key!r} ({message.kind!r}), which the transition at version "
                f"{message.version} emitted: a Then fed back by its handler must come after "
                "that transition",
                entry.version,
            )
        )
    return found
