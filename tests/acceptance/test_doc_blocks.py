"""Every python block of the README and of docs/ runs as written, or says why it does not.

A block runs in a namespace that has `flowlock`, `asyncio`, `database_url` (a fresh
PostgreSQL database of its own) and `redis_url` (the test Redis); a block with a top-level
`await` runs on an event loop, with `engine` as well: an open `flowlock.Engine` on
`database_url` with `flowlock.examples.approval()` registered. A URL on the host `db.internal`
(`postgresql://app@db.internal:5432/app`) stands for the reader's database: it is the test
database here. The README's Flask and Django files are served by test_readme_apps.py, and a
block marked `<!-- fragment -->` is only compiled (CONTRIBUTING, "Code in the docs").
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from doc_blocks import Block, every_block

import flowlock
import pg_budget

BLOCKS = every_block()
RUN = [b for b in BLOCKS if not b.fragment and b.file is None]
PLACEHOLDER = re.compile(r"postgresql://app@db\.internal(:5432)?/app")
APP_SECTIONS = {"### Flask", "### Django"}


def _is_async(block: Block) -> bool:
    """Whether the block awaits at its top level (it compiles to a coroutine)."""
    code = compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return bool(code.co_flags & inspect.CO_COROUTINE)


def _code(block: Block, database_url: str) -> Any:
    code = PLACEHOLDER.sub(database_url, block.code)
    # dont_inherit: a block runs as a reader's script would, without this module's
    # `from __future__ import annotations` (which left a Pydantic model's field types unresolved).
    return compile(code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


@pytest.fixture
def database_url(pg_url: str) -> Iterator[str]:
    """A fresh, empty database on the test server, dropped afterwards."""
    with pg_budget.fresh_database(pg_url, "docs") as url:
        yield url


def test_every_block_is_run_or_marked() -> None:
    """Each block is run by this module, or is a file of the README's Flask or Django app, or is
    a fragment on purpose that still compiles; the app files are only in those two sections."""
    assert len(RUN) >= 15, [b.id for b in RUN]
    for block in BLOCKS:
        if block.file is not None:
            assert block.source == "README.md" and block.section in APP_SECTIONS, block.id
            assert not block.fragment, block.id
        if block.fragment:
            compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("block", [b for b in RUN if not _is_async(b)], ids=lambda b: b.id)
def test_the_block_runs(block: Block, database_url: str, redis_url: str) -> None:
    """The block runs to its end as a script, its asserts holding."""
    namespace = {
        "__name__": "__docs__",
        "flowlock": flowlock,
        "asyncio": asyncio,
        "database_url": database_url,
        "redis_url": redis_url,
    }
    exec(_code(block, database_url), namespace)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[flowlock.Engine]:
    """An open engine on the block's database, with the approval workflow registered."""
    async with flowlock.Engine.connect(database_url) as engine:
        await engine.register(flowlock.examples.approval())
        yield engine


@pytest.mark.parametrize("block", [b for b in RUN if _is_async(b)], ids=lambda b: b.id)
async def test_the_async_block_runs(
    block: Block, engine: flowlock.Engine, database_url: str, redis_url: str
) -> None:
    """The block runs to its end on an event loop, with an open engine, its asserts holding."""
    namespace = {
        "__name__": "__docs__",
        "flowlock": flowlock,
        "asyncio": asyncio,
        "database_url": database_url,
        "redis_url": redis_url,
        "engine": engine,
    }
    done = eval(_code(block, database_url), namespace)
    if done is not None:
        await done
