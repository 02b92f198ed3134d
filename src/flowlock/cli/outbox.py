"""`flowlock outbox`: list outbox messages, and retry or drop one by hand."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Annotated, TypeVar

import typer
from rich.text import Text

from flowlock.cli._common import (
    ENV_DATABASE_URL,
    EPILOG,
    app,
    fail,
    stderr,
    stdout,
)
from flowlock.cli._table import Column, print_record, print_rows, print_wrapped
from flowlock.cli.inspect import AsJson, InspectDatabaseUrl, InspectSchema, _cell, _inspect, _json
from flowlock.cli.inspect import _when as when
from flowlock.core.errors import InvalidInput
from flowlock.core.outbox import Message, parse_key
from flowlock.engine import Engine
from flowlock.outbox._engine import MAX_PAGE
from flowlock.stores.base import OutboxStore

__all__ = ["drop", "list_messages", "outbox_app", "retry"]

_R = TypeVar("_R")

outbox_app = typer.Typer(
    help="The outbox: what transitions emitted, and where each delivery is. *list* reads; "
    "*retry* and *drop* repair one message by hand.",
    no_args_is_help=True,
    epilog=EPILOG,
    rich_markup_mode="markdown",
)
app.add_typer(outbox_app, name="outbox")


class Status(StrEnum):
    pending = "pending"
    running = "running"
    done = "done"
    dead = "dead"


RepairDatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar=ENV_DATABASE_URL,
        help="The database to repair: postgresql://user@host:5432/db or sqlite:///path/to/file.db.",
        show_default=False,
    ),
]
MessageKey = Annotated[
    str,
    typer.Argument(
        metavar="KEY",
        help="The message's key, INSTANCE:VERSION:N, as `flowlock outbox list` prints it.",
        show_default=False,
    ),
]


def _outbox(engine: Engine) -> OutboxStore:
    store = engine.store
    if not isinstance(store, OutboxStore):
        raise InvalidInput(
            f"{type(store).__name__} keeps no outbox; use a store that does (memory, SQLite or "
            "PostgreSQL of this flowlock version)"
        )
    return store


def _repair(
    database_url: str | None, schema: str | None, act: Callable[[Engine], Awaitable[_R]]
) -> _R:
    """`act(engine)` on an engine that may write (and fires and delivers nothing itself)."""
    return _inspect(database_url, schema, act, writes=True)


def _key(key: str) -> str:
    """`key` if it reads as a message key; a usage error (exit 2) otherwise."""
    try:
        parse_key(key)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc), param_hint="'KEY'") from None
    return key


async def _of_instance(
    engine: Engine,
    instance_id: str,
    status: str | None,
    kind: str | None,
    after: str | None,
    limit: int,
) -> list[Message]:
    """The instance's messages in emitting order (version, then n), filtered as find_messages
    filters every instance's, after the message `after` in that order."""
    await engine.get(instance_id)  # an unknown id is an error, not an empty list
    start = (-1, -1)
    if after is not None:
        owner, version, n = parse_key(after)
        if owner != instance_id:
            raise InvalidInput(
                f"--after {after!r} is a message of instance {owner!r}, not of --instance "
                f"{instance_id!r}; pass the last key of the previous page of this instance"
            )
        start = (version, n)
    found = [
        m
        for m in await engine.messages(instance_id)
        if (m.version, m.n) > start
        and (status is None or m.status == status)
        and (kind is None or m.kind == kind)
    ]
    return found[:limit]


_STYLE = {"dead": "bold red", "running": "cyan", "done": "green"}


def _title(found: list[Message], counts: Mapping[str, int], instance_id: str | None) -> str:
    where = f" of {instance_id}" if instance_id is not None else ""
    total = ", ".join(f"{counts.get(s, 0)} {s}" for s in Status)
    return f"{len(found)} message(s){where}; in all: {total}"


@outbox_app.command("list")
def list_messages(
    instance_id: Annotated[
        str | None,
        typer.Option(
            "--instance",
            "-i",
            help="Only this instance's messages, in the order its transitions emitted them "
            "(default: every instance's, by instance id, then version).",
            show_default=False,
        ),
    ] = None,
    status: Annotated[
        Status | None,
        typer.Option("--status", "-s", help="Only messages with this status.", show_default=False),
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option("--kind", "-k", help="Only messages of this kind.", show_default=False),
    ] = None,
    limit: Annotated[
        int,
        typer.Option(
            "--limit", "-n", min=1, max=MAX_PAGE, help="Print at most this many messages."
        ),
    ] = 100,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            metavar="KEY",
            help="Start after this message key: the last one of the previous page.",
            show_default=False,
        ),
    ] = None,
    as_json: AsJson = False,
    database_url: InspectDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """List outbox messages: key, kind, status, attempts, next attempt, last error, created.

    A status is pending (waiting to be delivered, or to be tried again at its next attempt),
    running (an engine delivers it now), done (delivered) or dead (given up: its handler
    failed max_attempts times, refused it with DeliveryRefused, or its Then was refused by the
    workflow; `flowlock outbox retry KEY` sends it again). The title counts
    every message by status. A page that is full ends with the key to pass as --after.

    Read-only. Exits 1 if --instance names no instance.
    """
    from flowlock._inspect import message_dict

    wanted = None if status is None else status.value

    async def read(engine: Engine) -> tuple[list[Message], Mapping[str, int]]:
        store = _outbox(engine)
        if instance_id is not None:
            found = await _of_instance(engine, instance_id, wanted, kind, after, limit)
        else:
            found = await engine.find_messages(status=wanted, kind=kind, after=after, limit=limit)
        return found, await store.count_messages()

    found, counts = _inspect(database_url, schema, read)
    next_after = found[-1].key if len(found) == limit else None
    if as_json:
        _json(
            {
                "counts": dict(counts),
                "messages": [message_dict(m) for m in found],
                "next_after": next_after,
            }
        )
        return
    columns = [
        Column("key"),
        Column("kind"),
        Column("status"),
        Column("attempts"),
        Column("next attempt"),
        Column("last error", text=True),
        Column("created"),
    ]
    print_rows(
        stdout(),
        _title(found, counts, instance_id),
        columns,
        [
            [
                _cell(m.key),
                _cell(m.kind),
                Text(m.status, style=_STYLE.get(m.status, "")),
                _cell(m.attempts),
                _cell(when(m.next_attempt_at) if m.status == "pending" else None),
                _cell(m.last_error),
                _cell(when(m.created_at)),
            ]
            for m in found
        ],
    )
    if next_after is not None:
        more = f"showing the first {limit}; for the next page pass --after {next_after!r}"
        stderr().print(Text(more, style="yellow"))


@outbox_app.command("retry")
def retry(
    key: MessageKey,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Deliver a dead (or waiting) message again now, its attempts counted from 0.

    A running engine with a handler for its kind picks it up at once; its last error is kept
    until the next attempt. A done message is never sent again, and one an engine is
    delivering now (running) is left to that delivery: retrying either is refused.

    Writes. Exits 1 if no message has that key, or it is done or running.
    """
    checked = _key(key)

    async def act(engine: Engine) -> Message:
        _outbox(engine)
        return await engine.retry_message(checked)  # refuses a done or running message

    message = _repair(database_url, schema, act)
    print_wrapped(
        stdout(),
        Text(
            f"message {message.key} ({message.kind}) is pending again: due now, attempts from 0",
            style="green",
        ),
    )


@outbox_app.command("drop")
def drop(
    key: MessageKey,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Drop without asking for confirmation.")
    ] = False,
    database_url: RepairDatabaseUrl = None,
    schema: InspectSchema = None,
) -> None:
    """Delete a message that will not be delivered: an operator gives up on it.

    Later messages of its instance, held back behind it, may then go. Asks for confirmation
    first, showing the message, unless --yes. Dropping a running message does not stop the
    delivery in flight.

    Writes. Exits 1 if no message has that key, or the confirmation is declined.
    """
    checked = _key(key)

    async def look(engine: Engine) -> Message:
        _outbox(engine)
        return await engine.message(checked)

    if not yes:
        message = _repair(database_url, schema, look)
        _show(message)
        if not _confirmed(f"Drop message {message.key}? It will never be delivered"):
            fail("not dropped: answer y to the question, or pass --yes")

    async def act(engine: Engine) -> None:
        _outbox(engine)
        await engine.drop_message(checked)

    _repair(database_url, schema, act)
    print_wrapped(stdout(), Text(f"dropped message {checked}", style="green"))


def _confirmed(question: str) -> bool:
    """The operator's answer; no answer (stdin closed, Ctrl-C) is a no."""
    try:
        return typer.confirm(question, default=False)
    except typer.Abort:
        stderr().print()
        return False


def _show(message: Message) -> None:
    fields = [
        (Column("key"), message.key),
        (Column("kind"), message.kind),
        (Column("status"), message.status),
        (Column("attempts"), message.attempts),
        (Column("last error", text=True), message.last_error),
        (Column("created"), when(message.created_at)),
    ]
    print_record(stderr(), [(column, _cell(value)) for column, value in fields])
    if message.status == "running":
        stderr().print(
            Text(
                "an engine is delivering it now: dropping it does not stop that delivery",
                style="yellow",
            )
        )
