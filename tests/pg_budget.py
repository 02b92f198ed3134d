"""The tests' own PostgreSQL connections, on a server that other clients share.

The suite must pass on a busy server: a stock ``max_connections=100`` while another client holds
60 of them. So:

- Every test keeps its pools (and its worker processes' and services' pools) small enough that
  it needs at most about 30 connections at once.
- A helper connection of a test (to count rows, hold a row lock, end a session) is not what
  the test is about. :func:`connect` and :func:`create_pool` retry a connection the server
  refuses for want of a slot ("too many clients", SQLSTATE 53300) for up to
  :data:`CONNECT_BOUND` seconds: the other clients' connections come and go. If no slot frees in
  that time, the test is skipped, saying so.
- A test that cannot run in about 30 connections (the benchmark's quick run) checks what the
  server has free first, and is skipped saying what it needs and what is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

__all__ = ["CONNECT_BOUND", "connect", "create_pool", "fresh_database"]

CONNECT_BOUND = 60.0
"""Seconds a helper connection is retried while the server has no free slot."""

_PAUSE = (0.05, 1.0)  # the first and the longest pause between two tries

_T = TypeVar("_T")


async def connect(dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect(dsn, **kwargs)``, retried while the server has no free slot (bounded:
    the test is skipped after :data:`CONNECT_BOUND` seconds, saying so)."""
    return await _retried(lambda: asyncpg.connect(dsn, **kwargs))


async def create_pool(dsn: str, **kwargs: Any) -> asyncpg.Pool:
    """``asyncpg.create_pool(dsn, **kwargs)``, its first connections retried as :func:`connect`
    retries one. A pool of the test's own, sized by the test."""

    async def opened() -> asyncpg.Pool:
        pool = await asyncpg.create_pool(dsn, **kwargs)
        assert pool is not None
        return pool

    return await _retried(opened)


async def _retried(open_it: Callable[[], Awaitable[_T]]) -> _T:
    deadline = time.monotonic() + CONNECT_BOUND
    pause = _PAUSE[0]
    while True:
        try:
            return await open_it()
        except asyncpg.TooManyConnectionsError as exc:
            if time.monotonic() + pause > deadline:
                pytest.skip(
                    f"PostgreSQL had no free connection for this test's helper for "
                    f"{CONNECT_BOUND:.0f} s ({exc}): other clients hold the server's "
                    "max_connections; free some, or raise max_connections"
                )
        await asyncio.sleep(pause)
        pause = min(2 * pause, _PAUSE[1])


@contextlib.contextmanager
def fresh_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new database named ``<prefix>_<random>`` on the server of ``server_url``; its URL is
    yielded, and it is dropped afterwards with whatever is still connected to it."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"

    async def execute(sql: str) -> None:
        conn = await connect(server_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(execute(f'CREATE DATABASE "{name}"'))
    try:
        yield urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
    finally:
        asyncio.run(execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def migrated(url: str, schema: str) -> asyncpg.Connection:
    """A connection to `schema`, migrated first by flowlock's PostgreSQL store (its search_path
    set to the schema): for tests that load rows with SQL and ask the planner about them."""
    from flowlock.stores.postgres import PostgresStore

    store = PostgresStore(url, schema=schema)
    await store.open()
    await store.aclose()
    conn = await connect(url)
    await conn.execute(f'SET search_path TO "{schema}"')
    return conn
