"""The one place asyncpg and OS errors become flowlock errors, for every PostgreSQL adapter.

A table of rules, most specific first; the PostgreSQL guide says how they are chosen.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import asyncpg

from flowlock.core.constraints import (
    CapacityReached,
    ConstraintRefused,
    RateLimited,
    UniqueViolation,
)
from flowlock.core.errors import (
    ConnectionLost,
    FlowlockError,
    LockUnavailable,
    MigrationError,
    OutcomeUnknown,
    StoreError,
    TooManyConnections,
)

__all__ = [
    "DRIVER_ERRORS",
    "REFUSED",
    "REQUEST_CONSTRAINT",
    "RULES",
    "Context",
    "Rule",
    "SessionGone",
    "broken",
    "cannot_connect",
    "check_order",
    "in_doubt",
    "read_only",
    "refusal",
    "refused",
    "server_gone",
    "too_many_clients",
    "translate",
    "wrap_connect",
    "wrap_errors",
]

# What an adapter's edge catches. TimeoutError and ConnectionError are OSErrors already; named
# for the reader. InternalClientError is how asyncpg reports a statement sent on a connection
# whose session the server has just ended (see "A session that ended" above).
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    ConnectionError,
    TimeoutError,
)

# The unique constraint on (instance_id, request_id) of flowlock_history.
REQUEST_CONSTRAINT = "flowlock_history_request_uniq"
# What flowlock_claims (017_constraints.sql) raises when a claim does not fit: its facts are
# JSON in the error's DETAIL.
REFUSED = "FL028"


class SessionGone(LockUnavailable):
    """A lock backend's session is gone or did not answer: the server ended it (idle-in-transaction
    timeout, terminated, restarted), the network failed, or a round trip outlived its timeout."""

    def __init__(self, backend: str, detail: str) -> None:
        super().__init__(backend, detail)


@dataclass(frozen=True, slots=True)
class Context:
    """What one adapter's call makes of the driver errors that mean something to it.

    `what` names the failed work in the catch-all message (`<what>: <Type>: <message>`);
    `tables` and `opener` word the MigrationError of a missing table (`<tables> missing ...
    open <opener> with auto_migrate=True`). The facets below are optional; an unset one passes
    its errors on to the next, more general rule:

    - `key`: the store's. The key its messages quote; with it a unique violation, a cancelled
      statement and a lost connection get a message of their own.
    - `busy`: what SQLSTATE 55P03 means here (`lock_timeout` expired, or NOWAIT / a try-lock
      found the lock held): LockTimeout or LockBusy, or a signal the caller catches.
    - `cancel_is_busy`: SQLSTATE 57014 (statement cancelled) counts as busy too.
    - `duplicate`: what the request-id unique constraint firing means here.
    - `lock_backend`: a lock backend's name. Its session ending, its connection failing and a
      refused login are then LockUnavailable of that backend (`SessionGone` for the first
      two), not StoreError.
    - `in_doubt`: a write may be on its way to the server (a COMMIT, an autocommit write): a
      session lost now is OutcomeUnknown instead of ConnectionLost. Set it with `in_doubt`
      around that statement only.
    """

    what: str
    tables: str
    opener: str
    key: str | None = None
    busy: Callable[[BaseException], FlowlockError] | None = None
    cancel_is_busy: bool = False
    duplicate: Callable[[BaseException], FlowlockError] | None = None
    lock_backend: str | None = None
    in_doubt: bool = False


Factory = Callable[[BaseException, Context], FlowlockError | None]


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table: errors of class (or SQLSTATE) `match`, and when `constraint` is
    given only those naming that constraint, are made into flowlock errors by `factory`."""

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
        """Whether this rule matches every error that `other` matches (so, placed before
        `other`, it would hide it)."""
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


def _server_ended(exc: BaseException, ctx: Context) -> FlowlockError | None:
    # The server ended the session (57P01 terminated, 57P02 crash, 57P03 starting or stopping,
    # 25P03 idle in transaction too long): the session and its transaction are gone.
    found = _session_ended(exc, ctx)
    return found if found is not None else _lost(exc, ctx)


def _too_many(exc: BaseException, ctx: Context) -> FlowlockError | None:
    # Raised while connecting, before anything of the call was sent. The same error for a store
    # and a lock backend: the server is full, not unreachable.
    return TooManyConnections(str(exc) or type(exc).__name__)


def too_many_clients(
    exc: BaseException, *, size: int = 0, waited: float = 0.0
) -> TooManyConnections | None:
    """TooManyConnections if the server refused a new connection for want of a slot (SQLSTATE
    53300), with the pool's bound `size` and the seconds `waited` for it; else None."""
    if getattr(exc, "sqlstate", None) != "53300":
        return None
    return TooManyConnections(str(exc) or type(exc).__name__, size=size, waited=waited)


def _read_only(exc: BaseException, ctx: Context) -> FlowlockError | None:
    # The server refused the write before doing anything: never in doubt, whatever was sent.
    detail = (
        "PostgreSQL refused the write because the server is read-only (a standby after a "
        "failover or switch-over, or default_transaction_read_only is on). A pool's "
        "connections to that server are replaced: with a multi-host URL and "
        "target_session_attrs=read-write the retry connects to the primary"
    )
    if ctx.lock_backend is not None:
        return SessionGone(ctx.lock_backend, detail)
    return ConnectionLost(ctx.key, detail)


def _no_primary(exc: BaseException, ctx: Context) -> FlowlockError | None:
    # Raised while connecting, before anything of the call was sent.
    detail = (
        f"no host of the URL is a server the URL's target_session_attrs accepts ({exc}); during "
        "a failover there is no primary for a few seconds: retry"
    )
    if ctx.lock_backend is not None:
        return SessionGone(ctx.lock_backend, detail)
    return ConnectionLost(ctx.key, detail)


def _no_answer(exc: BaseException, ctx: Context) -> FlowlockError | None:
    # A round trip that outlived its timeout (command_timeout, io_timeout): asyncpg has given up
    # on it mid-protocol, so its connection is terminated (see broken); a write it carried may
    # have reached the server (OutcomeUnknown where the context is in doubt).
    if ctx.lock_backend is None:
        return _lost(exc, ctx, "PostgreSQL did not answer within command_timeout")
    return SessionGone(ctx.lock_backend, "no answer in time")


def _connection_lost(exc: BaseException, ctx: Context) -> FlowlockError | None:
    if ctx.lock_backend is not None:
        return SessionGone(ctx.lock_backend, str(exc) or type(exc).__name__)
    return _lost(exc, ctx)


def _lost(exc: BaseException, ctx: Context, detail: str | None = None) -> FlowlockError:
    if detail is None:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if ctx.in_doubt and _maybe_sent(exc):
        return OutcomeUnknown(ctx.key, detail)
    return ConnectionLost(ctx.key, detail)


def _maybe_sent(exc: BaseException) -> bool:
    """Whether the statement that failed with `exc` may have reached the server. asyncpg
    refuses, before writing anything, a statement on a connection it knows to be closed or busy
    (InterfaceError) or whose session's FATAL message it has already read (InternalClientError
    "cannot switch to state"); any other loss may have come after the server got it."""
    if isinstance(exc, asyncpg.InterfaceError):
        return False
    return not (
        isinstance(exc, asyncpg.InternalClientError)
        and str(exc).startswith("cannot switch to state")
    )


def refused(exc: BaseException) -> bool:
    """Whether `exc` is a claim's refusal (SQLSTATE FL028): one statement failed, the session
    goes on."""
    return getattr(exc, "sqlstate", None) == REFUSED


def _refused(exc: BaseException, ctx: Context) -> FlowlockError | None:
    return refusal(exc)


def refusal(exc: BaseException) -> ConstraintRefused | StoreError:
    """The ConstraintRefused that flowlock_claims' error `exc` (SQLSTATE FL028) stands for
    (a StoreError if its facts cannot be read)."""
    try:
        facts = json.loads(getattr(exc, "detail", None) or "")
        rule, common = (
            facts["rule"],
            {
                "instance_id": str(facts["instance_id"]),
                "kind": str(facts["kind"]),
                "key": str(facts["key"]),
                "version": int(facts["version"]),
                "event": facts["event"],
            },
        )
        if rule == "unique":
            holders = facts["holders"] or []
            return UniqueViolation(**common, holder=holders[0] if holders else None)
        if rule == "rate":
            return RateLimited(
                **common,
                limit=int(facts["limit"]),
                per=float(facts["per"]),
                retry_after=float(facts["retry_after"]),
            )
        return CapacityReached(
            **common, limit=int(facts["limit"]), holders=[str(h) for h in facts["holders"] or []]
        )
    except (ValueError, KeyError, TypeError) as error:
        return StoreError(
            f"a constraint refused the commit, but its facts could not be read ({exc}; "
            f"{error}); nothing was written"
        )


def _catch_all(exc: BaseException, ctx: Context) -> FlowlockError:
    return StoreError(f"{ctx.what}: {type(exc).__name__}: {exc}")


# Most specific first (check_order holds it to that). The SQLSTATE rows are the server ending or
# refusing a session, named as in PostgreSQL's error code table.
RULES: tuple[Rule, ...] = (
    Rule(REFUSED, _refused),  # a claim that does not fit (017_constraints.sql)
    Rule(asyncpg.UniqueViolationError, _duplicate_request, constraint=REQUEST_CONSTRAINT),
    Rule(asyncpg.UniqueViolationError, _unique_violation),
    Rule(asyncpg.LockNotAvailableError, _lock_not_available),
    Rule(asyncpg.QueryCanceledError, _statement_cancelled),
    Rule(asyncpg.UndefinedTableError, _missing_table),
    Rule(asyncpg.InvalidAuthorizationSpecificationError, _login_refused),  # and 28P01 password
    Rule("25P03", _server_ended),  # idle_in_transaction_session_timeout
    Rule("25P02", _session_ended),  # in_failed_sql_transaction: an earlier statement broke it
    Rule("57P01", _server_ended),  # admin_shutdown (pg_terminate_backend, a fast shutdown)
    Rule("57P02", _server_ended),  # crash_shutdown
    Rule("57P03", _server_ended),  # cannot_connect_now (starting up, shutting down)
    Rule("53300", _too_many),  # too_many_connections: a new connection refused
    Rule("25006", _read_only),  # read_only_sql_transaction: a standby, after a failover
    Rule(TimeoutError, _no_answer),
    Rule(asyncpg.PostgresConnectionError, _connection_lost),  # 08xxx: connection_does_not_exist..
    # An argument asyncpg could not encode: refused before anything was sent.
    Rule(asyncpg.exceptions._base.DataError, _catch_all),
    Rule(asyncpg.InterfaceError, _connection_lost),  # "connection is closed", "another operation.."
    # No host of a multi-host URL matched target_session_attrs (a failover under way).
    Rule(asyncpg.exceptions.TargetServerAttributeNotMatched, _no_primary),
    Rule(asyncpg.InternalClientError, _connection_lost),  # a FATAL read while idle, see above
    Rule(OSError, _connection_lost),  # ConnectionResetError, "unexpected connection_lost() call"
    Rule(BaseException, _catch_all),
)


def check_order(rules: Sequence[Rule]) -> None:
    """Raise ValueError if a rule comes after a more general one that would hide it."""
    for i, later in enumerate(rules):
        for earlier in rules[:i]:
            if earlier.covers(later):
                raise ValueError(f"{later} is hidden by the more general {earlier} before it")


def translate(exc: BaseException, *, context: Context) -> FlowlockError:
    """The flowlock error for driver error `exc` in `context`: the first rule of
    `RULES` that matches and answers (the catch-all always does)."""
    for rule in RULES:
        if rule.matches(exc):
            found = rule.factory(exc, context)
            if found is not None:
                return found
    return _catch_all(exc, context)  # not reached: the table's last rule answers everything


@contextlib.contextmanager
def wrap_errors(context: Context) -> Iterator[None]:
    """Driver errors raised inside become flowlock errors (`translate`), `from` them."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise translate(exc, context=context) from exc


def in_doubt(context: Context) -> contextlib.AbstractContextManager[None]:
    """`wrap_errors` for a statement that may commit a write (a COMMIT, an autocommit
    INSERT or UPDATE): a session lost while it is in flight leaves its outcome unknown."""
    return wrap_errors(replace(context, in_doubt=True))


# SQLSTATEs with which the server ends the session (FATAL): its connection is of no more use.
_ENDED = frozenset({"57P01", "57P02", "57P03", "25P03", "53300"})
# ... and those of them that say the server is ending every session, not just this one.
_ENDED_ALL = frozenset({"57P01", "57P02", "57P03"})


def _driver_error(exc: BaseException) -> BaseException | None:
    """`exc` if it is a driver error, else the driver error it was translated from."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain of causes is short; never loop on a cycle
        if seen is None:
            return None
        if isinstance(seen, DRIVER_ERRORS):
            return seen
        seen = seen.__cause__
    return None


def broken(exc: BaseException) -> bool:
    """Whether `exc` (or the driver error a flowlock error was raised from) leaves its
    connection unusable, so it must be terminated rather than given back to its pool: any driver
    error but a server's answer to one statement in a session that goes on (a unique violation,
    a lock timeout, a cancelled statement...)."""
    err = _driver_error(exc)
    if err is None or isinstance(err, ValueError):  # asyncpg's DataError: a bad argument
        return False
    if isinstance(err, asyncpg.PostgresError):
        code = str(getattr(err, "sqlstate", "") or "")
        return code in _ENDED or code.startswith("08")
    return True


def server_gone(exc: BaseException) -> bool:
    """Whether `exc` says that the server ended the session or the network failed (not just
    that one round trip outlived its timeout): the pool's other connections, to the same server
    through the same network, are then likely dead too."""
    err = _driver_error(exc)
    if err is None or isinstance(err, TimeoutError | ValueError):
        return False
    if isinstance(err, asyncpg.PostgresError):
        code = str(getattr(err, "sqlstate", "") or "")
        return code in _ENDED_ALL or code.startswith("08")
    return True


def read_only(exc: BaseException) -> bool:
    """Whether `exc` says that the server refused a write because it is read-only (SQLSTATE
    25006): after a failover, a standby. The connection still works, but every write on it, and
    on the pool's other connections to the same server, would fail the same way: the pool
    helpers drop them all (see `flowlock._pg.pool.give_back`)."""
    err = _driver_error(exc)
    return isinstance(err, asyncpg.PostgresError) and getattr(err, "sqlstate", None) == "25006"


def cannot_connect(exc: BaseException, dsn: str) -> StoreError:
    """Opening connections to `dsn` failed, whatever the reason: TooManyConnections when the
    server had no free slot, a StoreError saying to check the URL and the server otherwise."""
    where = dsn.split("@")[-1]
    full = too_many_clients(exc)
    if full is not None:
        return TooManyConnections(f"at {where!r}: {full.detail}")
    return StoreError(
        f"cannot connect to PostgreSQL at {where!r}: {exc}; "
        "check the URL and that the server is running"
    )


@contextlib.contextmanager
def wrap_connect(dsn: str) -> Iterator[None]:
    """Driver errors raised inside (opening a pool, creating the schema) become
    `cannot_connect`'s StoreError."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise cannot_connect(exc, dsn) from exc
