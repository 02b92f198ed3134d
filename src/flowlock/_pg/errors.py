"""The one place asyncpg and OS errors become flowlock errors, for every PostgreSQL adapter.

The store, the advisory locks, the run-once jobs and the migration runner run their driver calls
inside :func:`wrap_errors` (or call :func:`translate`), each with a :class:`Context` saying what
differs for it: the key its messages quote, what a lock that is not available means to this call
(LockBusy, LockTimeout, a signal the caller catches), whether it is a lock backend. Everything
else, above all which driver error means what, is decided here, once.

Most specific match wins
------------------------
:data:`RULES` is a table of (exception class or SQLSTATE) -> factory, ordered most specific first
(a subclass before its base class, a rule with a constraint name before the same class without
one; :func:`check_order` proves it). The first rule that matches the error *and* whose factory
gives an answer for the caller's context wins. A factory answers None when its kind of failure
means nothing particular to this caller, and the error goes on to the next, more general rule,
down to the catch-all StoreError. So a TimeoutError is "no answer in time" to a lock backend and,
being an OSError, "lost the connection" to the store.

The flowlock error is raised ``from`` the driver's, so ``__cause__`` keeps the original.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import asyncpg

from flowlock.errors import FlowlockError, LockUnavailable, MigrationError, StoreError

__all__ = [
    "DRIVER_ERRORS",
    "REQUEST_CONSTRAINT",
    "RULES",
    "Context",
    "Rule",
    "SessionGone",
    "cannot_connect",
    "check_order",
    "translate",
    "wrap_connect",
    "wrap_errors",
]

# What an adapter's edge catches. TimeoutError is an OSError already; named for the reader.
# (asyncpg.InternalClientError is none of these and is not caught: no edge caught it before.)
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
    TimeoutError,
)

# The unique constraint on (instance_id, request_id) of flowlock_history.
REQUEST_CONSTRAINT = "flowlock_history_request_uniq"


class SessionGone(LockUnavailable):
    """A lock backend's session is gone or did not answer: the server ended it (idle-in-transaction
    timeout, terminated, restarted), the network failed, or a round trip outlived its timeout."""

    def __init__(self, backend: str, detail: str) -> None:
        super().__init__(backend, detail)


@dataclass(frozen=True, slots=True)
class Context:
    """What one adapter's call makes of the driver errors that mean something to it.

    ``what`` names the failed work in the catch-all message (``<what>: <Type>: <message>``);
    ``tables`` and ``opener`` word the MigrationError of a missing table (``<tables> missing ...
    open <opener> with auto_migrate=True``). The facets below are optional; an unset one passes
    its errors on to the next, more general rule:

    - ``key``: the store's. The key its messages quote; with it a unique violation, a cancelled
      statement and a lost connection get a message of their own.
    - ``busy``: what SQLSTATE 55P03 means here (``lock_timeout`` expired, or NOWAIT / a try-lock
      found the lock held): LockTimeout or LockBusy, or a signal the caller catches.
    - ``cancel_is_busy``: SQLSTATE 57014 (statement cancelled) counts as busy too.
    - ``duplicate``: what the request-id unique constraint firing means here.
    - ``lock_backend``: a lock backend's name. Its session ending, its connection failing and a
      refused login are then LockUnavailable of that backend (:class:`SessionGone` for the first
      two), not StoreError.
    """

    what: str
    tables: str
    opener: str
    key: str | None = None
    busy: Callable[[BaseException], FlowlockError] | None = None
    cancel_is_busy: bool = False
    duplicate: Callable[[BaseException], FlowlockError] | None = None
    lock_backend: str | None = None


Factory = Callable[[BaseException, Context], FlowlockError | None]


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table: errors of class (or SQLSTATE) ``match``, and when ``constraint`` is
    given only those naming that constraint, are made into flowlock errors by ``factory``."""

    match: type[BaseException] | str
    factory: Factory
    constraint: str | None = None

    def matches(self, exc: BaseException) -> bool:
        if isinstance(self.match, str):
            hit = getattr(exc, "sqlstate", None) == self.match
        else:
            hit = isinstance(exc, self.match)
        return hit and (
            self.constraint is None or getattr(exc, "constraint_name", None) == self.constraint
        )

    def covers(self, other: Rule) -> bool:
        """Whether this rule matches every error that ``other`` matches (so, placed before
        ``other``, it would hide it)."""
        if self.constraint is not None and self.constraint != other.constraint:
            return False
        if isinstance(self.match, str):
            # A SQLSTATE names one code; a class rule also matches subclasses with other codes.
            return other.match == self.match
        return issubclass(_as_class(other.match), self.match)


def _as_class(match: type[BaseException] | str) -> type[BaseException]:
    if not isinstance(match, str):
        return match
    for value in vars(asyncpg.exceptions).values():
        if (
            isinstance(value, type)
            and issubclass(value, asyncpg.PostgresError)
            and value.__dict__.get("sqlstate") == match
        ):
            return value
    return asyncpg.PostgresError  # a code asyncpg has no class for


# -- what each kind of failure becomes ---------------------------------------------------------


def _duplicate_request(exc: BaseException, ctx: Context) -> FlowlockError | None:
    return None if ctx.duplicate is None else ctx.duplicate(exc)


def _unique_violation(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.key is None:
        return None
    return StoreError(f"unexpected unique violation for {ctx.key!r}: {exc}")


def _lock_not_available(exc: BaseException, ctx: Context) -> FlowlockError | None:
    return None if ctx.busy is None else ctx.busy(exc)


def _statement_cancelled(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.cancel_is_busy and ctx.busy is not None:
        return ctx.busy(exc)
    if ctx.key is None:
        return None
    return StoreError(f"statement cancelled for {ctx.key!r} (statement_timeout?): {exc}")


def _missing_table(exc: BaseException, ctx: Context) -> FlowlockError | None:
    return MigrationError(
        f"{ctx.tables} missing ({exc}); run `flowlock db migrate` or open {ctx.opener} "
        "with auto_migrate=True"
    )


def _login_refused(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.lock_backend is None:
        return None
    return LockUnavailable(ctx.lock_backend, f"PostgreSQL refused the login: {exc}")


def _session_ended(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.lock_backend is None:
        return None
    return SessionGone(ctx.lock_backend, str(exc) or type(exc).__name__)


def _no_answer(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.lock_backend is None:
        return None
    return SessionGone(ctx.lock_backend, "no answer in time")


def _connection_lost(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.lock_backend is not None:
        return SessionGone(ctx.lock_backend, str(exc) or type(exc).__name__)
    if ctx.key is None:
        return None
    return StoreError(
        f"lost the connection to PostgreSQL while working on {ctx.key!r}: {exc}; "
        "the transaction was rolled back, nothing was written"
    )


def _catch_all(exc: BaseException, ctx: Context) -> FlowlockError:
    return StoreError(f"{ctx.what}: {type(exc).__name__}: {exc}")


# Most specific first (check_order holds it to that). The SQLSTATE rows are the server ending or
# refusing a session, named as in PostgreSQL's error code table.
RULES: tuple[Rule, ...] = (
    Rule(asyncpg.UniqueViolationError, _duplicate_request, constraint=REQUEST_CONSTRAINT),
    Rule(asyncpg.UniqueViolationError, _unique_violation),
    Rule(asyncpg.LockNotAvailableError, _lock_not_available),
    Rule(asyncpg.QueryCanceledError, _statement_cancelled),
    Rule(asyncpg.UndefinedTableError, _missing_table),
    Rule(asyncpg.InvalidAuthorizationSpecificationError, _login_refused),  # and 28P01 password
    Rule("25P03", _session_ended),  # idle_in_transaction_session_timeout
    Rule("25P02", _session_ended),  # in_failed_sql_transaction: an earlier statement broke it
    Rule("57P01", _session_ended),  # admin_shutdown (pg_terminate_backend, a fast shutdown)
    Rule("57P02", _session_ended),  # crash_shutdown
    Rule("57P03", _session_ended),  # cannot_connect_now (starting up, shutting down)
    Rule("53300", _session_ended),  # too_many_connections
    Rule(TimeoutError, _no_answer),
    Rule(asyncpg.PostgresConnectionError, _connection_lost),  # 08xxx: connection_does_not_exist..
    Rule(asyncpg.InterfaceError, _connection_lost),  # "connection is closed", bad arguments too
    Rule(OSError, _connection_lost),
    Rule(BaseException, _catch_all),
)


def check_order(rules: Sequence[Rule]) -> None:
    """Raise ValueError if a rule comes after a more general one that would hide it."""
    for i, later in enumerate(rules):
        for earlier in rules[:i]:
            if earlier.covers(later):
                raise ValueError(f"{later} is hidden by the more general {earlier} before it")


def translate(exc: BaseException, *, context: Context) -> FlowlockError:
    """The flowlock error for driver error ``exc`` in ``context``: the first rule of
    :data:`RULES` that matches and answers (the catch-all always does)."""
    for rule in RULES:
        if rule.matches(exc):
            found = rule.factory(exc, context)
            if found is not None:
                return found
    return _catch_all(exc, context)  # not reached: the table's last rule answers everything


@contextlib.contextmanager
def wrap_errors(context: Context) -> Iterator[None]:
    """Driver errors raised inside become flowlock errors (:func:`translate`), ``from`` them."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise translate(exc, context=context) from exc


def cannot_connect(exc: BaseException, dsn: str) -> StoreError:
    """Opening connections to ``dsn`` failed, whatever the reason."""
    return StoreError(
        f"cannot connect to PostgreSQL at {dsn.split('@')[-1]!r}: {exc}; "
        "check the URL and that the server is running"
    )


@contextlib.contextmanager
def wrap_connect(dsn: str) -> Iterator[None]:
    """Driver errors raised inside (opening a pool, creating the schema) become
    :func:`cannot_connect`'s StoreError."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise cannot_connect(exc, dsn) from exc
