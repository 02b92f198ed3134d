"""flowlock._pg.errors, the one translation of driver errors for every PostgreSQL adapter: each
asyncpg exception class / SQLSTATE becomes the flowlock error (type and message) that adapter
raised before the translation was shared, the most specific rule wins, and ``__cause__`` keeps
the driver's error. No server needed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from flowlock._pg import migrations
from flowlock._pg.errors import (
    RULES,
    Context,
    Rule,
    SessionGone,
    check_order,
    translate,
    wrap_connect,
    wrap_errors,
)
from flowlock._pg.pool import connection
from flowlock.errors import (
    FlowlockError,
    LockBusy,
    LockTimeout,
    LockUnavailable,
    MigrationError,
    StoreBusy,
    StoreError,
)
from flowlock.jobs import _ERRORS as JOBS
from flowlock.locks.advisory import _ERRORS as ADVISORY
from flowlock.locks.advisory import _Busy
from flowlock.stores.postgres import _DuplicateRequest
from flowlock.stores.postgres import _errors as store_errors

STORE = store_errors("k")


def pg(code: str, message: str, **fields: str) -> asyncpg.PostgresError:
    """A server error as asyncpg builds it from the wire (class chosen by SQLSTATE)."""
    return asyncpg.PostgresError.new({"C": code, "M": message, **fields})


def gone(detail: str) -> str:
    return f"the advisory lock backend is unreachable ({detail}); nothing was written. " + (
        "Check the server and retry"
    )


def lost(exc: BaseException) -> str:
    return (
        f"lost the connection to PostgreSQL while working on 'k': {exc}; "
        "the transaction was rolled back, nothing was written"
    )


def missing(tables: str, opener: str, exc: BaseException) -> str:
    return (
        f"{tables} missing ({exc}); run `flowlock db migrate` or open {opener} "
        "with auto_migrate=True"
    )


def store_other(exc: BaseException) -> str:
    return f"PostgreSQL error for 'k': {type(exc).__name__}: {exc}"


def advisory_other(exc: BaseException) -> str:
    return f"PostgreSQL error in the advisory lock backend: {type(exc).__name__}: {exc}"


def jobs_other(exc: BaseException) -> str:
    return f"recording a job run failed: {type(exc).__name__}: {exc}"


Expect = tuple[type[FlowlockError], Callable[[BaseException], str]]

LOCK_TIMEOUT = pg("55P03", "canceling statement due to lock timeout")
CANCELLED = pg("57014", "canceling statement due to statement timeout")
DUPLICATE = pg(
    "23505",
    'duplicate key value violates unique constraint "flowlock_history_request_uniq"',
    n="flowlock_history_request_uniq",
)
UNIQUE = pg("23505", 'duplicate key value violates unique constraint "x_pkey"', n="x_pkey")
NO_TABLE = pg("42P01", 'relation "flowlock_fences" does not exist')
BAD_PASSWORD = pg("28P01", 'password authentication failed for user "x"')
NO_ROLE = pg("28000", 'role "x" does not exist')
SESSION_ENDED = [
    pg("25P03", "terminating connection due to idle-in-transaction timeout"),
    pg("25P02", "current transaction is aborted"),
    pg("57P01", "terminating connection due to administrator command"),
    pg("57P02", "terminating connection because of crash of another server process"),
    pg("57P03", "the database system is starting up"),
    pg("53300", "sorry, too many clients already"),
]
CONNECTION = [
    asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    asyncpg.PostgresConnectionError("connection failure"),
    pg("08001", "could not connect"),
    asyncpg.InterfaceError("connection is closed"),
    ConnectionRefusedError(111, "Connect call failed"),
    OSError("network is unreachable"),
]
OTHER = [
    pg("22012", "division by zero"),
    pg("42601", 'syntax error at or near "SELEC"'),
    asyncpg.InternalClientError("unexpected state"),
]


def cases() -> list[Any]:
    """(error, what the store / the advisory locks / the jobs make of it)."""
    rows: list[tuple[BaseException, Expect, Expect, Expect]] = [
        (
            LOCK_TIMEOUT,
            (StoreError, str),
            (_Busy, str),
            (StoreError, jobs_other),
        ),
        (
            CANCELLED,
            (StoreError, lambda e: f"statement cancelled for 'k' (statement_timeout?): {e}"),
            (_Busy, str),
            (StoreError, jobs_other),
        ),
        (
            DUPLICATE,
            (_DuplicateRequest, str),
            (StoreError, advisory_other),
            (StoreError, jobs_other),
        ),
        (
            UNIQUE,
            (StoreError, lambda e: f"unexpected unique violation for 'k': {e}"),
            (StoreError, advisory_other),
            (StoreError, jobs_other),
        ),
        (
            NO_TABLE,
            (MigrationError, lambda e: missing("flowlock tables are", "the engine", e)),
            (
                MigrationError,
                lambda e: missing("flowlock_fences is", "the advisory lock backend", e),
            ),
            (MigrationError, lambda e: missing("flowlock_job_runs is", "the runner", e)),
        ),
        *[
            (
                exc,
                (StoreError, store_other),
                (LockUnavailable, lambda e: gone(f"PostgreSQL refused the login: {e}")),
                (StoreError, jobs_other),
            )
            for exc in (BAD_PASSWORD, NO_ROLE)
        ],
        *[
            (
                exc,
                (StoreError, store_other),
                (SessionGone, lambda e: gone(str(e))),
                (StoreError, jobs_other),
            )
            for exc in SESSION_ENDED
        ],
        *[
            (
                exc,
                (StoreError, lost),
                (SessionGone, lambda e: gone(str(e))),
                (StoreError, jobs_other),
            )
            for exc in CONNECTION
        ],
        (
            TimeoutError(),
            (StoreError, lost),
            (SessionGone, lambda e: gone("no answer in time")),
            (StoreError, jobs_other),
        ),
        *[
            (exc, (StoreError, store_other), (StoreError, advisory_other), (StoreError, jobs_other))
            for exc in OTHER
        ],
    ]
    return [pytest.param(*row, id=f"{type(row[0]).__name__}-{i}") for i, row in enumerate(rows)]


@pytest.mark.parametrize(("exc", "store", "advisory", "jobs"), cases())
def test_each_driver_error_becomes_what_each_adapter_raised(
    exc: BaseException, store: Expect, advisory: Expect, jobs: Expect
) -> None:
    """Every asyncpg class / SQLSTATE in the table, and OSError / TimeoutError, gives each
    adapter's error type (exactly) and message."""
    for context, (kind, message) in ((STORE, store), (ADVISORY, advisory), (JOBS, jobs)):
        found = translate(exc, context=context)
        assert type(found) is kind, (context.what, found)
        assert str(found) == message(exc), context.what


def test_the_table_is_ordered_most_specific_first() -> None:
    """No rule comes after a more general one that would hide it."""
    check_order(RULES)


def test_a_general_rule_before_a_specific_one_is_refused() -> None:
    """check_order catches a subclass, a SQLSTATE or a constraint rule placed too late."""

    def any_error(exc: BaseException, ctx: Context) -> FlowlockError:
        return StoreError()

    for general, specific in (
        (Rule(OSError, any_error), Rule(TimeoutError, any_error)),
        (Rule(asyncpg.PostgresConnectionError, any_error), Rule("08003", any_error)),
        (
            Rule(asyncpg.UniqueViolationError, any_error),
            Rule(asyncpg.UniqueViolationError, any_error, constraint="c"),
        ),
    ):
        check_order([specific, general])
        with pytest.raises(ValueError, match="hidden"):
            check_order([general, specific])


def test_most_specific_match_wins() -> None:
    """A subclass's rule wins over its base class's: TimeoutError (an OSError) is "no answer in
    time" to a lock backend, the request-id constraint is a duplicate request to the store, and
    a wrong password (28P01, under 28000) is a refused login."""
    assert translate(TimeoutError(), context=ADVISORY).detail == "no answer in time"  # type: ignore[attr-defined]
    assert type(translate(DUPLICATE, context=STORE)) is _DuplicateRequest
    assert "refused the login" in str(translate(BAD_PASSWORD, context=ADVISORY))


def test_a_rule_without_meaning_for_the_caller_passes_to_the_next() -> None:
    """The store has no "no answer" of its own: its TimeoutError goes on to the OSError rule.
    The jobs have no meaning for a lost connection: it goes on to the catch-all."""
    assert str(translate(TimeoutError("t"), context=STORE)).startswith("lost the connection")
    assert str(translate(OSError("x"), context=JOBS)) == "recording a job run failed: OSError: x"


def test_a_sqlstate_rule_matches_by_code() -> None:
    """A SQLSTATE rule matches any error carrying the code, whatever class asyncpg chose."""
    exc = asyncpg.exceptions.UnknownPostgresError("terminating connection")
    exc.sqlstate = "57P01"  # type: ignore[misc]
    assert type(translate(exc, context=ADVISORY)) is SessionGone


def test_busy_means_what_the_caller_says() -> None:
    """55P03 is LockTimeout or LockBusy as the store's call decides, and 57014 is busy only to
    a backend that asks for it."""
    timeout = store_errors("k", lambda _: LockTimeout("k", 0.2))
    nowait = store_errors("k", lambda _: LockBusy("k"))
    assert type(translate(LOCK_TIMEOUT, context=timeout)) is LockTimeout
    assert type(translate(LOCK_TIMEOUT, context=nowait)) is LockBusy
    assert type(translate(CANCELLED, context=timeout)) is StoreError


def test_migrations_word_errors_as_the_store() -> None:
    """The migration runner's errors read as the store's did, for the key ''."""
    found = translate(pg("42601", "syntax error"), context=migrations._CONTEXT)
    assert str(found) == "PostgreSQL error for '': PostgresSyntaxError: syntax error"
    assert str(translate(LOCK_TIMEOUT, context=migrations._CONTEXT)) == str(LOCK_TIMEOUT)


@pytest.mark.parametrize("exc", [LOCK_TIMEOUT, NO_TABLE, TimeoutError(), OSError("x")])
def test_wrap_errors_raises_from_the_driver_error(exc: BaseException) -> None:
    """wrap_errors raises the translation ``from`` the driver's error: ``__cause__`` keeps it."""
    with pytest.raises(FlowlockError) as caught, wrap_errors(ADVISORY):
        raise exc
    assert caught.value.__cause__ is exc
    assert type(caught.value) is type(translate(exc, context=ADVISORY))


@pytest.mark.parametrize(
    "exc", [ValueError("x"), asyncio.CancelledError(), asyncpg.InternalClientError("x")]
)
def test_wrap_errors_lets_other_errors_through(exc: BaseException) -> None:
    """Only driver errors are translated (InternalClientError was caught by no edge before)."""
    with pytest.raises(type(exc)) as caught, wrap_errors(STORE):
        raise exc
    assert caught.value is exc


def test_wrap_connect_says_what_to_check() -> None:
    """A failure to connect names the host (never the password) and what to check."""
    exc = ConnectionRefusedError(111, "Connect call failed")
    with pytest.raises(StoreError) as caught, wrap_connect("postgresql://u:secret@db:5432/app"):
        raise exc
    assert str(caught.value) == (
        f"cannot connect to PostgreSQL at 'db:5432/app': {exc}; "
        "check the URL and that the server is running"
    )
    assert caught.value.__cause__ is exc


class _Pool:
    """Just enough of an asyncpg pool for :func:`connection`."""

    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail
        self.released: list[object] = []

    async def acquire(self, timeout: float) -> object:  # noqa: ASYNC109 (asyncpg's signature)
        if self.fail is not None:
            raise self.fail
        return "conn"

    async def release(self, conn: object) -> None:
        self.released.append(conn)

    def is_closing(self) -> bool:
        return False


async def test_connection_translates_and_gives_back() -> None:
    """No free connection in time is StoreBusy; an error at acquire or inside is translated,
    and the connection goes back to the pool either way."""
    with pytest.raises(StoreBusy):
        async with connection(_Pool(TimeoutError()), acquire_timeout=0.1, size=3, context=JOBS):  # type: ignore[arg-type]
            pass
    with pytest.raises(MigrationError):
        async with connection(_Pool(NO_TABLE), acquire_timeout=0.1, size=3, context=JOBS):  # type: ignore[arg-type]
            pass
    pool = _Pool(None)
    with pytest.raises(StoreError, match="lost the connection") as caught:
        async with connection(pool, acquire_timeout=0.1, size=3, context=STORE):  # type: ignore[arg-type]
            raise asyncpg.InterfaceError("connection is closed")
    assert isinstance(caught.value.__cause__, asyncpg.InterfaceError)
    assert pool.released == ["conn"]
