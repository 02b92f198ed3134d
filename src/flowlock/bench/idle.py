"""The idle cost: what one engine sends while nothing is due (timers) or pending (outbox).

The timers section measures it with timers armed and none due, the outbox section with a
handler registered, messages done and none pending. Counted on the server, in a database of its
own (created for the measurement and dropped after it), so that everything seen there is the
engine's. The engine opens, settles, and is watched for the window:

- the statements its connections start, seen in `pg_stat_activity` every few milliseconds
  from a connection to another database. A connection shows the statement it runs or ran
  last, so two statements of one connection between two looks count once (a lower bound of
  the count), but a connection that sends anything is always seen sending something;
- the scans of each flowlock table, which the server counts exactly: read when the window
  opens and after the engine's connections are gone (a connection hands in its counts at the
  latest 10 s after its last statement, and all of them when it ends). A full run settles 11
  s first, so the startup's scans are in before the window opens; `--quick` settles for less
  and counts no scans.

Not the database's transaction counters: an idle connection runs a short transaction of its
own whenever other sessions' catalog changes or notifications pile up for it, so those count
the whole server's activity too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
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

__all__ = [
    "IDLE_AHEAD",
    "KINDS",
    "OUTBOX_TABLE",
    "SAMPLE",
    "IdleWatch",
    "Watched",
    "measure_idle",
    "method",
    "statement_kind",
    "watch_idle",
    "with_database",
]

IDLE_AHEAD = 86_400.0
"""How far ahead the idle measurement's timers fall due: a day, so none falls due meanwhile."""
SAMPLE = 0.005
"""Seconds between two looks at the engine's connections in `pg_stat_activity`."""
_GONE_BOUND = 15.0  # the longest wait for the engine's connections to end


def with_database(url: str, name: str) -> str:
    """`url` naming the database `name` instead of its own."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


KINDS = ("timers", "outbox", "listen", "escalations", "other")
"""The kinds of statement the idle cost counts apart (see `statement_kind`)."""
OUTBOX_TABLE = "flowlock_outbox"
"""The outbox's table: the dispatcher's statements name it."""
_LISTENERS = ("-timers", "-outbox")  # how the LISTEN connections name themselves


def statement_kind(app: str, query: str) -> str:
    """What sent a statement: `timers` (it names the timers' table), `outbox` (the outbox's),
    `listen` (a LISTEN connection's own, named `...-timers` or `...-outbox`), `escalations`
    (the adaptive strategy's board: its clock and its escalations) or `other`."""
    if app.endswith(_LISTENERS):
        return "listen"
    if "flowlock_timers" in query:
        return "timers"
    if OUTBOX_TABLE in query:
        return "outbox"
    if "flowlock_escalations" in query or "clock_timestamp()" in query:
        return "escalations"
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
        counts = dict.fromkeys(KINDS, 0)
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
class IdleWatch:
    """How long to let the engine settle, how long to watch it, whether to count scans."""

    settle_s: float
    window_s: float
    scans: bool


@dataclass(frozen=True, slots=True)
class Watched:
    """What the watch of one engine found: its statements by kind in the window, each table's
    scans (None when not counted), the window on the server's clock, other backends seen."""

    counted: Mapping[str, int]
    scans: Mapping[str, int] | None
    window: tuple[float, float]
    others: int

    @property
    def span(self) -> float:
        return self.window[1] - self.window[0]

    def per_second(self) -> dict[str, float]:
        span = self.span
        return {k: n / span for k, n in self.counted.items()} if span > 0 else {}

    def scans_per_second(self) -> dict[str, float] | None:
        span = self.span
        if self.scans is None or span <= 0:
            return None
        return {t: n / span for t, n in self.scans.items()}


async def _watched(
    run: Run,
    target: Target,
    admin: asyncpg.Connection,
    name: str,
    how: IdleWatch,
    engine: Callable[[Target], Awaitable[None]],
    seen: _Seen,
) -> tuple[dict[str, int] | None, tuple[float, float]]:
    """One engine (opened by `engine` in the first worker process), open for the settle time
    and then watched for the window: each table's scans from the window's start to after the
    engine was gone (None when `how` counts none), and the window (server clock)."""
    like = target.application_name
    await _quiet(admin, name, like, seen)
    await engine(target)
    try:
        await asyncio.sleep(how.settle_s)
        before = await _scans(target.url) if how.scans else None
        window = await _watch(admin, name, like, how.window_s, seen)
    finally:
        await close_engines(run, 1)
    await _quiet(admin, name, like, seen)
    if before is None:
        return None, window
    after = await _scans(target.url)
    return {t: after.get(t, 0) - before.get(t, 0) for t in after}, window


async def watch_idle(
    run: Run,
    suffix: str,
    how: IdleWatch,
    prepare: Callable[[str, Target], Awaitable[None]],
    engine: Callable[[Target], Awaitable[None]],
    notes: list[str],
    what: str,
) -> Watched | None:
    """Watch one engine in a database of its own, named after the run's schema and `suffix`.

    `prepare(url, target)` fills the database first; `engine(target)` opens the engine in the
    first worker process. None, with a note saying why, when the server refuses a database of
    the bench's own. `what` names the measurement in errors and notes.
    """
    name = f"{run.target.schema}_{suffix}"
    url = with_database(run.target.url, name)
    target = replace(run.target, url=url)
    seen = _Seen()
    admin = await connect(run.target.url)
    try:
        try:
            await admin.execute(CREATE_DATABASE.format(name=name))
        except asyncpg.InsufficientPrivilegeError as exc:
            notes.append(
                f"{what} was not measured: it needs a database of its own, and the "
                f"server refused to create one ({exc}); give a role with CREATEDB"
            )
            return None
        try:
            await prepare(url, target)
            scans, window = await _watched(run, target, admin, name, how, engine, seen)
        finally:
            await admin.execute(DROP_DATABASE.format(name=name))
    except DRIVER_ERRORS as exc:
        raise store_error(exc, url, f"{what} could not be measured") from exc
    finally:
        await admin.close()
    if seen.others:
        notes.append(
            f"{what}'s database had {len(seen.others)} other backend(s) meanwhile "
            "(autovacuum): their statements are not counted, their table scans may be"
        )
    start, end = window
    return Watched(seen.between(start, end), scans, window, len(seen.others))


def method(how: IdleWatch) -> str:
    """How the idle cost was counted, in words (the JSON's `method`)."""
    return (
        f"pg_stat_activity every {SAMPLE * 1000:g} ms (statements started: a lower bound)"
        + (" and pg_stat_user_tables (seq_scan + idx_scan)" if how.scans else "")
        + f", after {how.settle_s:g} s of settling"
    )


async def _prepare(url: str, target: Target, load: TimerLoad) -> None:
    """Migrate the database, arm its timers (due a day ahead), vacuum and analyse it."""
    await prepare_schema(url, target.schema, [SCENARIOS["deadline"]])
    conn = await schema_connection(url, target.schema)
    try:
        await arm(conn, "idle-", load.idle_armed, IDLE_AHEAD, 1000.0)
        await conn.execute(VACUUM)  # so that autovacuum has nothing to do there meanwhile
    finally:
        await conn.close()


def _how(load: TimerLoad) -> IdleWatch:
    return IdleWatch(load.idle_settle_s, load.idle_window_s, load.idle_scans)


async def measure_idle(run: Run, load: TimerLoad, notes: list[str]) -> IdleFigures | None:
    """The idle cost of one engine with `load.idle_armed` timers armed, none due.

    None, with a note saying why, when the server refuses a database of the bench's own.
    """

    async def prepare(url: str, target: Target) -> None:
        await _prepare(url, target, load)

    async def engine(target: Target) -> None:
        await open_engines(run, target, 1, "idle", timers=True)

    how = _how(load)
    watched = await watch_idle(run, "idle", how, prepare, engine, notes, "the idle cost")
    if watched is None:
        return None
    return IdleFigures(
        engines=1,
        armed=load.idle_armed,
        window_s=watched.span,
        statements_per_s=watched.per_second(),
        scans_per_s=watched.scans_per_second(),
        database="dedicated",
        method=method(how),
        others_seen=watched.others,
    )
