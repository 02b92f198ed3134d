"""The one translation of redis-py's and the OS's errors for the Redis lock backend: every one of
them becomes LockUnavailable raised from it, wherever a call to Redis fails; nothing else is
touched."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import redis.exceptions

from flowlock.core.errors import FlowlockError, LockUnavailable
from flowlock.locks.redis.connection import DRIVER_ERRORS, bounded, close, translate

# Every exception class redis-py defines (a new one in a later version is swept in too), and
# what the OS raises under a socket: reset, refused, broken pipe, a timeout.
REDIS_ERRORS = sorted(
    (
        cls
        for cls in vars(redis.exceptions).values()
        if inspect.isclass(cls) and issubclass(cls, BaseException)
    ),
    key=lambda cls: cls.__name__,
)
OS_ERRORS: list[type[BaseException]] = [
    ConnectionResetError,
    ConnectionRefusedError,
    BrokenPipeError,
    OSError,
]


def _instance(cls: type[BaseException]) -> BaseException:
    try:
        return cls("boom")
    except (TypeError, ValueError):  # a constructor that wants more (an address, a slot...)
        return cls.__new__(cls)


@pytest.mark.parametrize("cls", REDIS_ERRORS + OS_ERRORS, ids=lambda c: c.__name__)
async def test_every_driver_error_is_lock_unavailable_from_it(cls: type[BaseException]) -> None:
    """BusyLoadingError (a restarting Redis), ReadOnlyError (a replica), ResponseError,
    ConnectionError, TimeoutError, redis-py's cluster and lock errors, the OS's socket errors:
    each one, raised by a call to Redis, becomes LockUnavailable with the driver's error as its
    cause and the call named in the message."""
    error = _instance(cls)
    assert isinstance(error, DRIVER_ERRORS), f"{cls.__name__} would escape untranslated"

    async def call() -> None:
        raise error

    with pytest.raises(LockUnavailable) as caught:
        await bounded("extend", call(), 1.0)
    assert caught.value.__cause__ is error
    assert caught.value.backend == "redis"
    assert "extend" in str(caught.value)


async def test_a_call_without_an_answer_in_time_says_so() -> None:
    """The call's own bound is a LockUnavailable saying how long it waited."""
    with pytest.raises(LockUnavailable, match=r"acquire: no answer within 0\.05 s"):
        await bounded("acquire", asyncio.sleep(10), 0.05)


@pytest.mark.parametrize("exc", [ValueError("x"), KeyError("x"), FlowlockError("x")])
async def test_errors_that_are_not_the_drivers_pass_through(exc: Exception) -> None:
    """Only driver errors are translated: anything else is a bug (or already typed) and keeps
    its own type."""

    async def call() -> None:
        raise exc

    with pytest.raises(type(exc)) as caught:
        await bounded("release", call(), 1.0)
    assert caught.value is exc


def test_translate_always_answers_lock_unavailable() -> None:
    """translate() is total over the driver errors: one type, the cause's name in the detail."""
    found = translate("owned", redis.exceptions.ReadOnlyError("READONLY replica"), 2.0)
    assert isinstance(found, LockUnavailable)
    assert "ReadOnlyError" in found.detail and "READONLY replica" in found.detail


async def test_closing_a_broken_client_raises_nothing() -> None:
    """Closing a client whose connections fail to say goodbye is logged, never raised."""

    class Broken:
        async def aclose(self) -> None:
            raise redis.exceptions.ConnectionError("Connection closed by server.")

    await close(Broken(), 1.0)  # type: ignore[arg-type]


def test_an_acl_refusal_names_the_commands_to_grant() -> None:
    """A Redis user whose ACL denies @dangerous cannot run INFO, which the acquire script runs
    to stamp the fencing counter: the error says which commands to grant."""
    refused = redis.exceptions.ResponseError(
        "The user executing the script can't run this command or subcommand script: c1c2"
    )
    message = str(translate("start the fencing counter", refused, 1.0))
    assert "+info" in message and "INFO" in message
    assert "+info" not in str(
        translate("acquire", redis.exceptions.ResponseError("WRONGTYPE"), 1.0)
    )
