"""The README's Queries section, run as written against PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import flowlock
import pg_budget
from flowlock.checker import check_many

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def queries_snippet() -> Callable[[flowlock.Engine], Awaitable[dict[str, Any]]]:
    """The python block of the README's "## Queries" section, as an async function of
    ``engine`` that returns the snippet's variables."""
    section = README.split("\n## Queries\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "the Queries section has no python block"
    body = textwrap.indent(found.group(1) + "return locals()\n", "    ")
    namespace: dict[str, Any] = {}
    exec(f"async def snippet(engine):\n{body}", namespace)
    run: Callable[[flowlock.Engine], Awaitable[dict[str, Any]]] = namespace["snippet"]
    return run


@pytest.mark.slow
async def test_the_readme_queries_example_rejects_what_waited_a_week(
    pg_engine_factory: Callable[..., Awaitable[flowlock.Engine]],
    pg_url: str,
    pg_schema: str,
    sql_history: Callable[..., Any],
) -> None:
    """The example counts the pending approvals and rejects, page by page, exactly the pending
    ones last changed more than a week ago (made so by the test's own SQL); run again, it finds
    nothing left to reject."""
    engine = await pg_engine_factory()
    ids = [f"req-{n:04d}" for n in range(1200)]
    await asyncio.gather(*(engine.create("approval", instance_id=iid) for iid in ids))
    approved = ids[::7]
    await asyncio.gather(*(engine.fire(iid, "approve") for iid in approved))
    old = [iid for iid in ids[::2] if iid not in approved]  # more than one page of 500
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        await conn.execute(
            "UPDATE flowlock_instances SET updated_at = now() - interval '8 days' "
            "WHERE id = ANY($1::text[])",
            old,
        )
    finally:
        await conn.close()

    snippet = queries_snippet()
    seen = await snippet(engine)
    assert seen["pending"] == len(ids) - len(approved)
    assert seen["page"].next_cursor is None

    assert await walk(engine, "approval", "rejected") == old
    assert await engine.count("approval", "pending") == len(ids) - len(approved) - len(old)
    for iid in old:
        [entry] = await engine.history(iid)
        assert (entry.event, entry.actor, entry.request_id) == ("reject", "expiry", f"expire-{iid}")

    again = await snippet(engine)  # nothing waited a week any more
    assert again["pending"] == len(ids) - len(approved) - len(old)
    assert await engine.count("approval", "rejected") == len(old)
    histories = {iid: await engine.history(iid) for iid in ids}
    verdict = check_many(
        [(await engine.get(iid), histories[iid]) for iid in ids],
        initial_state="pending",
        expected_applied={iid: 1 if iid in approved or iid in old else 0 for iid in ids},
    )
    assert verdict.ok, verdict.violations
    (await sql_history()).assert_matches(histories)


async def walk(engine: flowlock.Engine, workflow: str, state: str) -> list[str]:
    """The ids of every page of ``engine.list(workflow, state)``."""
    page = await engine.list(workflow, state, limit=100)
    found = [i.id for i in page]
    while page.next_cursor is not None:
        page = await engine.list(workflow, state, limit=100, after=page.next_cursor)
        found.extend(i.id for i in page)
    return found
