"""flowlock._pg.errors, the one translation of driver errors for every PostgreSQL adapter: each
asyncpg exception class / SQLSTATE becomes the flowlock error (type and message) of that adapter,
the most specific rule wins, and ``__cause__`` keeps the driver's error; a session lost under a
write in flight is OutcomeUnknown; a broken connection is terminated, not given back. No server
needed (the same on a real server: tests/integration/test_connection_loss_pg.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from flowlock._pg import migrations
from flowlock._pg.errors import (
    DRIVER_ERRORS,
    RULES,
    Context,
    Rule,
    SessionGone,
    broken,
    check_order,
    in_doubt,
    read_only,
    server_gone,
    too_many_clients,
    translate,
    wrap_connect,
    wrap_errors,
)
from flowlock._pg.pool import connection, give_back
from flowlock.core.errors import (
    ConnectionLost,
    FlowlockError,
    LockBusy,
    LockTimeout,
    LockUnavailable,
    MigrationError,
    OutcomeUnknown,
    StoreBusy,
    StoreError,
    TooManyConnections,
)
from flowlock.jobs import _ERRORS as JOBS
from flowlock.locks.advisory.errors import ERRORS as ADVISORY
from flowlock.locks.advisory.errors import Busy as _Busy
from flowlock.stores.postgres.session import DuplicateRequest as _DuplicateRequest
from flowlock.stores.postgres.session import context_of as store_errors

STORE = store_errors("k")


def pg(code: str, message: str, **fields: str) -> asyncpg.PostgresError:
    """A server error as asyncpg builds it from the wire (class chosen by SQLSTATE)."""
    return asyncpg.PostgresError.new({"C": code, "M": message, **fields})


def gone(detail: str) -> str:
    return f"the advisory lock backend is unreachable ({detail}); nothing was written. " + (
        "Check the server and retry"
    )


NO_ANSWER = "PostgreSQL did not answer within command_timeout"


def lost(exc: BaseException) -> str:
    return str(ConnectionLost("k", f"{type(exc).__name__}: {exc}" if str(exc) else "TimeoutError"))


def jobs_lost(exc: BaseException) -> str:
    return str(ConnectionLost(None, f"{type(exc).__name__}: {exc}" if str(exc) else "TimeoutError"))


def missing(tables: str, opener: str, exc: BaseException) -> str:
    return (
        f"{tables} missing ({exc}); run `flowlock db migrate` or open {opener} "
        "with auto_migrate=True"
    )


def too_many(exc: BaseException) -> str:
    return str(TooManyConnections(str(exc)))


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
# The server ends the session: the store lost it (ConnectionLost).
SERVER_ENDED = [
    pg("25P03", "terminating connection due to idle-in-transaction timeout"),
    pg("57P01", "terminating connection due to administrator command"),
    pg("57P02", "terminating connection because of crash of another server process"),
    pg("57P03", "the database system is starting up"),
]
# Ends a lock backend's session, means nothing particular to the store.
SESSION_ENDED = [pg("25P02", "current transaction is aborted")]
# A new connection refused: every one of the server's max_connections is in use.
TOO_MANY = pg("53300", "sorry, too many clients already")
# asyncpg read the server's FATAL message while the connection sat idle; the next statement:
STATE = asyncpg.InternalClientError(
    "cannot switch to state 15; another operation (2) is in progress"
)
CONNECTION = [
    asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    asyncpg.PostgresConnectionError("connection failure"),
    pg("08001", "could not connect"),
    asyncpg.InterfaceError("connection is closed"),
    STATE,
    asyncpg.exceptions.ProtocolError("unexpected message"),
    ConnectionRefusedError(111, "Connect call failed"),
    ConnectionError("unexpected connection_lost() call"),
    OSError("network is unreachable"),
]
# A write refused by a server that is read-only (after a failover, a standby): never in doubt.
READ_ONLY = pg("25006", "cannot execute UPDATE in a read-only transaction")
READ_ONLY_DETAIL = (
    "PostgreSQL refused the write because the server is read-only (a standby after a failover "
    "or switch-over, or default_transaction_read_only is on). A pool's connections to that "
    "server are replaced: with a multi-host URL and target_session_attrs=read-write the retry "
    "connects to the primary"
)
# No host of a multi-host URL is a primary (a failover under way): raised while connecting.
NO_PRIMARY = asyncpg.exceptions.TargetServerAttributeNotMatched(
    "None of the hosts match the target attribute requirement <SessionAttribute.read_write>"
)


def no_primary(exc: BaseException) -> str:
    return (
        f"no host of the URL is a server the URL's target_session_attrs accepts ({exc}); "
        "during a failover there is no primary for a few seconds: retry"
    )


OTHER = [
    pg("22012", "division by zero"),
    pg("42601", 'syntax error at or near "SELEC"'),
    asyncpg.exceptions._base.DataError("invalid input for query argument $1: 'x'"),
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
                (ConnectionLost, lost),
                (SessionGone, lambda e: gone(str(e))),
                (ConnectionLost, jobs_lost),
            )
            for exc in SERVER_ENDED
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
                (ConnectionLost, lost),
                (SessionGone, lambda e: gone(str(e))),
                (ConnectionLost, jobs_lost),
            )
            for exc in CONNECTION
        ],
        (
            # The same for every adapter: the server is full, not unreachable.
            TOO_MANY,
            (TooManyConnections, too_many),
            (TooManyConnections, too_many),
            (TooManyConnections, too_many),
        ),
        (
            READ_ONLY,
            (ConnectionLost, lambda e: str(ConnectionLost("k", READ_ONLY_DETAIL))),
            (SessionGone, lambda e: gone(READ_ONLY_DETAIL)),
            (ConnectionLost, lambda e: str(ConnectionLost(None, READ_ONLY_DETAIL))),
        ),
        (
            NO_PRIMARY,
            (ConnectionLost, lambda e: str(ConnectionLost("k", no_primary(e)))),
            (SessionGone, lambda e: gone(no_primary(e))),
            (ConnectionLost, lambda e: str(ConnectionLost(None, no_primary(e)))),
        ),
        (
            # asyncpg's command_timeout: the message says which bound ran out.
            TimeoutError(),
            (ConnectionLost, lambda e: str(ConnectionLost("k", NO_ANSWER))),
            (SessionGone, lambda e: gone("no answer in time")),
            (ConnectionLost, lambda e: str(ConnectionLost(None, NO_ANSWER))),
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
    """A lock that is not available means nothing particular to the jobs: it goes on to the
    catch-all. A session the server ended (25P02) is a lock backend's concern only."""
    assert str(translate(LOCK_TIMEOUT, context=JOBS)) == jobs_other(LOCK_TIMEOUT)
    assert str(translate(SESSION_ENDED[0], context=STORE)) == store_other(SESSION_ENDED[0])


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


@pytest.mark.parametrize("exc", [ValueError("x"), asyncio.CancelledError(), RuntimeError("x")])
def test_wrap_errors_lets_other_errors_through(exc: BaseException) -> None:
    """Only driver errors are translated."""
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


def test_a_full_server_is_too_many_connections_not_a_bad_url() -> None:
    """A server with no free connection slot (53300) refusing the first connection is
    TooManyConnections (a StoreBusy: back off and retry), naming the host, saying that
    max_connections is in use and what to do, and not telling to check the URL."""
    with pytest.raises(TooManyConnections) as caught, wrap_connect("postgresql://u:pw@db:5432/a"):
        raise TOO_MANY
    message = str(caught.value)
    assert isinstance(caught.value, StoreBusy) and caught.value.__cause__ is TOO_MANY
    assert "'db:5432/a'" in message and "pw" not in message
    assert "sorry, too many clients already" in message
    assert "max_connections are in use" in message and "lower max_size" in message
    assert "check the URL" not in message
    assert too_many_clients(NO_TABLE) is None and too_many_clients(TimeoutError()) is None


def test_every_asyncpg_error_is_a_driver_error() -> None:
    """What the edges catch covers every exception asyncpg raises (InternalClientError too, how
    asyncpg reports a statement on a connection whose session the server has just ended), and
    ConnectionError, which asyncpg raises from a lost socket."""
    for exc in (STATE, asyncpg.exceptions.ProtocolError("x"), ConnectionError("x"), *CONNECTION):
        assert isinstance(exc, DRIVER_ERRORS), exc
    with pytest.raises(ConnectionLost) as caught, wrap_errors(STORE):
        raise STATE
    assert caught.value.__cause__ is STATE


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        # Sent (or maybe sent) before the session was lost: the write may have committed.
        (CONNECTION[0], OutcomeUnknown),
        (pg("57P01", "terminating connection due to administrator command"), OutcomeUnknown),
        (TimeoutError(), OutcomeUnknown),
        (OSError("reset"), OutcomeUnknown),
        (asyncpg.exceptions.ProtocolError("unexpected message"), OutcomeUnknown),
        # Refused by asyncpg before anything was sent: nothing was written.
        (asyncpg.InterfaceError("connection is closed"), ConnectionLost),
        (STATE, ConnectionLost),
        # The server refused the write (a standby now), or nothing was sent (no primary found).
        (READ_ONLY, ConnectionLost),
        (NO_PRIMARY, ConnectionLost),
        # Not a lost session at all: what it always is.
        (LOCK_TIMEOUT, StoreError),
        (DUPLICATE, _DuplicateRequest),
    ],
)
def test_a_session_lost_under_a_write_in_flight_is_outcome_unknown(
    exc: BaseException, kind: type[FlowlockError]
) -> None:
    """Inside in_doubt (a COMMIT, an autocommit write) a session lost after the statement may
    have reached the server is OutcomeUnknown, which tells to retry with the same request id;
    one asyncpg refused to send is ConnectionLost."""
    with pytest.raises(FlowlockError) as caught, in_doubt(STORE):
        raise exc
    assert type(caught.value) is kind, caught.value
    assert caught.value.__cause__ is exc
    if kind is OutcomeUnknown:
        assert "same request_id" in str(caught.value)
        assert "may or may not have been committed" in str(caught.value)
    # The same error outside a write in flight, and a lock backend's, are never in doubt.
    assert type(translate(exc, context=STORE)) is not OutcomeUnknown
    assert type(translate(exc, context=replace(ADVISORY, in_doubt=True))) is not OutcomeUnknown


def test_broken_says_which_connections_are_of_no_more_use() -> None:
    """A lost session, a FATAL message, an asyncpg state error or a timeout leaves its connection
    unusable (also when it is the cause of a flowlock error); a server's answer to one statement
    in a session that goes on, a bad argument, or a non-driver error does not."""
    unusable: list[BaseException] = [
        *SERVER_ENDED,
        *CONNECTION,
        TimeoutError(),
        pg("53300", "too many clients"),
    ]
    usable: list[BaseException] = [
        LOCK_TIMEOUT,
        CANCELLED,
        DUPLICATE,
        UNIQUE,
        NO_TABLE,
        pg("25P02", "current transaction is aborted"),
        *OTHER,
        ValueError("x"),
        asyncio.CancelledError(),
    ]
    for exc in unusable:
        assert broken(exc), exc
        assert broken(_from(exc)), exc
    for exc in usable:
        assert not broken(exc), exc
        assert not broken(_from(exc))
    # The server ending sessions (or the network failing) dooms the pool's other connections
    # too; one round trip timing out or a session's own idle timeout does not.
    gone_everywhere: list[BaseException] = [*SERVER_ENDED[1:], *CONNECTION]
    for exc in gone_everywhere:
        assert server_gone(exc) and server_gone(_from(exc)), exc
    for exc in [TimeoutError(), SERVER_ENDED[0], *usable]:
        assert not server_gone(exc), exc


def test_read_only_says_the_server_refused_a_write_as_a_standby() -> None:
    """25006 (a write on a standby: the old primary after a failover) is read_only, also as the
    cause of a flowlock error; the session goes on (not broken, not gone), so a caller's own
    transaction can still be rolled back to flowlock's savepoint. Nothing else is read_only."""
    assert read_only(READ_ONLY) and read_only(_from(READ_ONLY))
    assert not broken(READ_ONLY) and not server_gone(READ_ONLY)
    for exc in [*SERVER_ENDED, *SESSION_ENDED, *CONNECTION, *OTHER, LOCK_TIMEOUT, NO_PRIMARY]:
        assert not read_only(exc), exc
        assert not read_only(_from(exc)), exc


def _from(exc: BaseException) -> FlowlockError:
    """A flowlock error raised from ``exc``, as wrap_errors raises it."""
    try:
        with wrap_errors(STORE):
            raise exc
    except FlowlockError as translated:
        return translated
    except BaseException:
        wrapped = StoreError("not a driver error")
        wrapped.__cause__ = exc
        return wrapped
    raise AssertionError("not reached")


class _Conn:
    """Just enough of a pooled connection: counts terminate()."""

    def __init__(self) -> None:
        self.terminated = 0

    def terminate(self) -> None:
        self.terminated += 1


class _Pool:
    """Just enough of an asyncpg pool for :func:`connection`."""

    def __init__(self, fail: BaseException | None, release_fails: bool = False) -> None:
        self.fail = fail
        self.conn = _Conn()
        self.released: list[object] = []
        self.expired = 0
        self.release_fails = release_fails

    async def acquire(self, timeout: float) -> object:  # noqa: ASYNC109 (asyncpg's signature)
        if self.fail is not None:
            raise self.fail
        return self.conn

    async def release(self, conn: object) -> None:
        self.released.append(conn)
        if self.release_fails:
            raise asyncpg.InternalClientError("cannot switch to state 15")

    async def expire_connections(self) -> None:
        self.expired += 1

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
    # Acquiring sends nothing: a session lost then is never in doubt.
    with pytest.raises(ConnectionLost):
        async with connection(
            _Pool(CONNECTION[0]),  # type: ignore[arg-type]
            acquire_timeout=0.1,
            size=3,
            context=replace(STORE, in_doubt=True),
        ):
            pass
    pool = _Pool(None)
    with pytest.raises(ConnectionLost, match="lost the connection") as caught:
        async with connection(pool, acquire_timeout=0.1, size=3, context=STORE):  # type: ignore[arg-type]
            raise asyncpg.InterfaceError("connection is closed")
    assert isinstance(caught.value.__cause__, asyncpg.InterfaceError)
    assert pool.released == [pool.conn]


async def test_a_pool_that_cannot_grow_on_a_full_server_says_so() -> None:
    """A pool with room whose new connection the server refuses (no free slot) raises
    TooManyConnections with the pool's bound, for a store and for a lock backend alike."""
    for context in (STORE, ADVISORY, JOBS):
        with pytest.raises(TooManyConnections, match="for a pool of 3 that had room") as caught:
            async with connection(_Pool(TOO_MANY), acquire_timeout=0.1, size=3, context=context):  # type: ignore[arg-type]
                pass
        assert caught.value.size == 3 and caught.value.__cause__ is TOO_MANY


async def test_a_broken_connection_is_terminated_and_the_pool_renewed() -> None:
    """A connection whose session the server ended, or whose server refused a write as a
    standby, is terminated (its pool opens a fresh one) and the pool's other connections are
    expired; after an ordinary server error the pool is left alone, after a timeout only that
    connection is terminated; a failure to give a connection back raises nothing."""
    cases: list[tuple[BaseException, type[BaseException], int, int]] = [
        (STATE, ConnectionLost, 1, 1),
        (pg("57P01", "terminating connection"), ConnectionLost, 1, 1),
        # A write on a standby: that connection and the pool's others reach a read-only server.
        (READ_ONLY, ConnectionLost, 1, 1),
        (TimeoutError(), ConnectionLost, 1, 0),
        (LOCK_TIMEOUT, StoreError, 0, 0),
        (ValueError("a bug"), ValueError, 0, 0),
    ]
    for exc, raised, terminated, expired in cases:
        pool = _Pool(None)
        with pytest.raises(raised):
            async with connection(pool, acquire_timeout=0.1, size=3, context=STORE):  # type: ignore[arg-type]
                raise exc
        assert (pool.conn.terminated, pool.expired) == (terminated, expired), exc
        assert pool.released == [pool.conn]
    pool = _Pool(None, release_fails=True)
    async with connection(pool, acquire_timeout=0.1, size=3, context=STORE):  # type: ignore[arg-type]
        pass  # the call succeeded: a failed reset on the way back must not turn it into an error
    assert pool.conn.terminated == 1
    await give_back(pool, pool.conn)  # type: ignore[arg-type]


def _asyncpg_errors() -> list[type[BaseException]]:
    """Every exception class asyncpg defines that it raises (its warnings are only ever issued
    as warnings or log messages)."""
    found: dict[str, type[BaseException]] = {}
    for module in (asyncpg, asyncpg.exceptions, asyncpg.exceptions._base):
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and issubclass(cls, Exception)
                and not issubclass(cls, Warning)
                and cls.__module__.startswith("asyncpg")
            ):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


@pytest.mark.parametrize("cls", _asyncpg_errors(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("context", [STORE, ADVISORY, JOBS], ids=["store", "advisory", "jobs"])
def test_every_asyncpg_exception_class_becomes_a_flowlock_error(
    cls: type[BaseException], context: Any
) -> None:
    """Each of the about 270 exception classes of asyncpg, raised inside any adapter's
    wrap_errors, comes out as a flowlock error raised from it: none escapes untranslated."""
    try:
        exc = cls("boom")
    except TypeError:  # a constructor that wants more
        exc = cls.__new__(cls)
        exc.args = ("boom",)
    assert isinstance(exc, DRIVER_ERRORS), f"{cls.__name__} is not caught at the edges"
    with pytest.raises(FlowlockError) as caught, wrap_errors(context):
        raise exc
    assert caught.value.__cause__ is exc
