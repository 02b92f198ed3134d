"""The timers section's idle cost: what one engine sends while timers are armed and none is due.

Counted on the server, in a database of its own (created for the measurement and dropped after
it), so that everything seen there is the engine's. Two counts:

- the statements its connections start, seen in `pg_stat_activity` every few milliseconds
  from a connection to another database (a lower bound: two statements on one connection
  between two looks count once);
- the scans of each flowlock table, which the server counts exactly but reports only now and
  then, and all of them when a connection ends. So the engine is run twice, for a short life
  and for a life longer by the measured window, each counted from before it opens to after its
  last connection is gone; the difference is the window's, with the startup counted out.

Not the database's transaction counters: an idle connection runs a short transaction of its
own whenever other sessions' catalog changes or notifications pile up for it, so those count
the whole server's activity too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from flowlock.bench.config import Target
from flowlock.bench.pairs import Run
from flowlock.bench.scenarios import SCENARIOS
from flowlock.bench.servers import DRIVER_ERRORS, OWN_APPLICATION_NAME, connect, store_error
from flowlock.bench.session import prepare_schema
from flowlock.bench.timer_load import (
    TimerLoad,
    arm,
    close_engines,
    open_engines,
    schema_connection,
)
from flowlock.bench.timer_results import IdleFigures
from flowlock.bench.timer_sql import (
    ACTIVITY,
    CLOCK,
    CREATE_DATABASE,
    DROP_DATABASE,
    TABLE_SCANS,
    VACUUM,
)

__all__ = ["IDLE_AHEAD", "SAMPLE", "measure_idle", "statement_kind", "with_database"]

IDLE_AHEAD = 86_400.0
"""How far ahead the idle measurement's timers fall due: a day, so none falls due meanwhile."""
SAMPLE = 0.005
"""Seconds between two looks at the engine's connections in `pg_stat_activity`."""
_GONE_BOUND = 15.0  # the longest wait for the engine's connections to end


def with_database(url: str, name: str) -> str:
    """`url` naming the database `name` instead of its own."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def statement_kind(app: str, query: str) -> str:
    """`timers` for a statement on the timers' table, `listen` for one of the LISTEN
    connection (named `...-timers`), `other` for the rest."""
    if "flowlock_timers" in query and not query.lstrip().upper().startswith("LISTEN"):
        return "timers"
    if app.endswith("-timers"):
        return "listen"
    return "other"


@dataclass(slots=True)
class _Seen:
    """What the looks at `pg_stat_activity` found: statements by (pid, start), and the pids of
    backends that were not the engine's."""

    statements: dict[tuple[int, float], str] = field(default_factory=dict)
    others: set[int] = field(default_factory=set)

    def look(self, rows: list[asyncpg.Record], like: str) -> int:
        """Take one look's rows; how many of them are connections."""
        for row in rows:
            if row["app"] == OWN_APPLICATION_NAME:
                continue  # this runner's own reads of the table scans
            if row["kind"] != "client backend" or not row["app"].startswith(like):
                self.others.add(row["pid"])
            elif row["started"] is not None:
                key = (row["pid"], row["started"])
                self.statements.setdefault(key, statement_kind(row["app"], row["query"] or ""))
        return len(rows)

    def between(self, start: float, end: float) -> dict[str, int]:
        counts: dict[str, int] = {"timers": 0, "listen": 0, "other": 0}
        for (_, started), kind in self.statements.items():
            if start <= started < end:
                counts[kind] += 1
        return counts


async def _scans(url: str) -> dict[str, int]:
    """Scans of each flowlock table so far, read on a connection that ends at once."""
    conn = await connect(url)
    try:
        return {r["name"]: int(r["scans"]) for r in await conn.fetch(TABLE_SCANS)}
    finally:
        await conn.close()


async def _quiet(admin: asyncpg.Connection, name: str, like: str, seen: _Seen) -> None:
    """Wait (at most `_GONE_BOUND` seconds) until nobody is connected to database `name`."""
    until = time.monotonic() + _GONE_BOUND
    while True:
        connected = seen.look(await admin.fetch(ACTIVITY, name), like)
        if not connected or time.monotonic() >= until:
            return
        await asyncio.sleep(0.05)


async def _watch(
    admin: asyncpg.Connection, name: str, like: str, seconds: float, seen: _Seen
) -> tuple[float, float]:
    """Look at database `name` every `SAMPLE` seconds for `seconds`; the window's start and end
    on the server's clock."""
    start = float(await admin.fetchval(CLOCK))
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        seen.look(await admin.fetch(ACTIVITY, name), like)
        await asyncio.sleep(SAMPLE)
    return start, float(await admin.fetchval(CLOCK))


@dataclass(frozen=True, slots=True)
class _Life:
    """One life of the engine: its table scans, how long it was open, and the window watched."""

    scans: Mapping[str, int]
    lived: float
    window: tuple[float, float] | None


async def _life(
    run: Run,
    target: Target,
    admin: asyncpg.Connection,
    name: str,
    load: TimerLoad,
    seen: _Seen,
    *,
    watch: bool,
) -> _Life:
    """One engine, open for the settle time (and, when `watch`, the window, watched)."""
    like = target.application_name
    before = await _scans(target.url)
    await _quiet(admin, name, like, seen)
    await open_engines(run, target, 1, "idle", timers=True)
    opened = time.monotonic()
    window: tuple[float, float] | None = None
    try:
        await asyncio.sleep(load.idle_settle_s)
        if watch:
            window = await _watch(admin, name, like, load.idle_window_s, seen)
    finally:
        await close_engines(run, 1)
        lived = time.monotonic() - opened
    await _quiet(admin, name, like, seen)
    after = await _scans(target.url)
    return _Life({t: after.get(t, 0) - before.get(t, 0) for t in after}, lived, window)


async def _prepare(url: str, target: Target, load: TimerLoad) -> None:
    """Migrate the database, arm its timers (due a day ahead), vacuum and analyse it."""
    await prepare_schema(url, target.schema, [SCENARIOS["deadline"]])
    conn = await schema_connection(url, target.schema)
    try:
        await arm(conn, "idle-", load.idle_armed, IDLE_AHEAD, 1000.0)
        await conn.execute(VACUUM)  # so that autovacuum has nothing to do there meanwhile
    finally:
        await conn.close()


def _figures(short: _Life, long: _Life, seen: _Seen, load: TimerLoad) -> IdleFigures:
    lived = long.lived - short.lived
    assert long.window is not None
    start, end = long.window
    window = end - start
    statements = {k: n / window for k, n in seen.between(start, end).items()} if window else {}
    scans = {t: (n - short.scans.get(t, 0)) / lived for t, n in long.scans.items()} if lived else {}
    return IdleFigures(
        engines=1,
        armed=load.idle_armed,
        window_s=window,
        statements_per_s=statements,
        scans_per_s=scans,
        database="dedicated",
        method=(
            f"pg_stat_activity every {SAMPLE * 1000:g} ms (statements started, a lower bound) "
            "and pg_stat_user_tables (seq_scan + idx_scan of a short and a longer life of "
            "the engine)"
        ),
        others_seen=len(seen.others),
    )


async def measure_idle(run: Run, load: TimerLoad, notes: list[str]) -> IdleFigures | None:
    """The idle cost of one engine with `load.idle_armed` timers armed, none due.

    None, with a note saying why, when the server refuses a database of the bench's own.
    """
    name = f"{run.target.schema}_idle"
    url = with_database(run.target.url, name)
    target = replace(run.target, url=url)
    seen = _Seen()
    admin = await connect(run.target.url)
    try:
        try:
            await admin.execute(CREATE_DATABASE.format(name=name))
        except asyncpg.InsufficientPrivilegeError as exc:
            notes.append(
                f"the idle cost was not measured: it needs a database of its own, and the "
                f"server refused to create one ({exc}); give a role with CREATEDB"
            )
            return None
        try:
            await _prepare(url, target, load)
            short = await _life(run, target, admin, name, load, seen, watch=False)
            long = await _life(run, target, admin, name, load, seen, watch=True)
        finally:
            await admin.execute(DROP_DATABASE.format(name=name))
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, "the timers' idle measurement failed") from exc
    finally:
        await admin.close()
    if seen.others:
        notes.append(
            f"the idle cost's database had {len(seen.others)} other backend(s) meanwhile "
            "(autovacuum): their statements are not counted, their table scans may be"
        )
    return _figures(short, long, seen, load)
