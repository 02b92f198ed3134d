"""Capacities, uniqueness and rate limits across OS processes sharing one database.

The workers (constraint_worker.py) start together through a gate and every test shows that
their contended phases overlapped. Then the database is read with the tests' own SQL
(constraint_kit): each key's slot log replayed +1 / -1 in seq order never holds more than the
limit, the slot rows per key equal the counter and the instances in the state, the rate log
never holds more than the limit in any window; and the exactly-once checker (what `flowlock
check` runs) reads the whole database clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from proc_worker import Gate, Phase

import flowlock
import pg_budget
from constraint_kit import (
    DESK_KIND,
    LIMIT,
    RATE,
    RATE_PER,
    REVIEW_KIND,
    THROTTLE_KIND,
    UNIQUE_KIND,
    Rows,
    rate_proof,
    read_pg,
    read_sqlite,
    slot_proof,
    workflows,
)
from flowlock._inspect import check_instances
from flowlock.stores.postgres import PostgresStore
from flowlock.stores.sqlite import SqliteStore

WORKER = Path(__file__).with_name("constraint_worker.py")
PROCESSES = 4
BOUND = 90.0  # the most a test waits for its workers
STRATEGIES = ["optimistic", "pessimistic", "distributed", "adaptive"]
# What a storm's callers may be told besides "applied": the key is full, the instance moved
# under them (another process's call got there first), or the instance's own contention.
EXPECTED = {
    "CapacityReached",
    "TransitionNotAllowed",
    "ConflictRetriesExhausted",
    "LockTimeout",
    "LockBusy",
}

SqlHistory = Callable[..., Awaitable[Any]]


async def _spawn(confs: Sequence[dict[str, Any]]) -> list[asyncio.subprocess.Process]:
    return [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            json.dumps(conf),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for conf in confs
    ]


async def _reports(procs: Sequence[asyncio.subprocess.Process]) -> list[dict[str, Any]]:
    reports = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=BOUND)
        assert proc.returncode == 0, err.decode()[-3000:]
        reports.append(json.loads(out.decode().splitlines()[-1]))
    return reports


async def _stop(procs: Sequence[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _run(gate: Gate, confs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs the workers through one gate; their reports, once their phases overlapped."""
    procs = await _spawn(confs)
    try:
        await gate.open_when_ready(procs)
        reports = await _reports(procs)
    finally:
        await _stop(procs)
    gate.assert_overlapped()
    return reports


def _total(reports: Sequence[dict[str, Any]], field: str) -> Counter[str]:
    total: Counter[str] = Counter()
    for report in reports:
        total.update(report[field])
    return total


async def _checked(
    engine: flowlock.Engine, url: str, schema: str | None, rows: Rows | None = None
) -> dict[str, Any]:
    """The exactly-once checker over the whole database: through the engine, then as the
    command `flowlock check --json` in a process of its own; its report. With `rows` (read
    after the run), both read every slot and rate event the tests' SQL read."""
    report = await check_instances(engine, None)
    assert report.verdict.ok, report.verdict.describe()
    where = ["--database-url", url, *(["--schema", schema] if schema else [])]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowlock", "check", "--json", *where,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=BOUND)
    assert proc.returncode == 0, (out.decode()[-3000:], err.decode()[-3000:])
    found: dict[str, Any] = json.loads(out)
    assert found["instances"] == report.instances, found
    if rows is not None:
        events = (len(rows.log), len(rows.rates))
        assert (report.slot_events, report.rate_events) == events, (report, events)
        assert (found["slot_events"], found["rate_events"]) == events, (found, events)
    return found


def _reviewer(data: dict[str, Any]) -> object:
    return data["reviewer"]


async def _pg_engine(pg_url: str, pg_schema: str) -> flowlock.Engine:
    engine = await flowlock.Engine(PostgresStore(pg_url, schema=pg_schema, pool_size=2)).open()
    for wf in workflows():
        await engine.register(wf)
    return engine


async def _reviews(engine: flowlock.Engine, count: int, keys: Sequence[str]) -> list[str]:
    ids = [f"r{n:03}" for n in range(count)]
    for n, iid in enumerate(ids):
        await engine.create("review", instance_id=iid, data={"reviewer": keys[n % len(keys)]})
    return ids


def _locks(request: pytest.FixtureRequest, strategy: str) -> dict[str, Any]:
    """The Redis a distributed run's workers lease on, under a namespace of the test's own."""
    if strategy != "distributed":
        return {}
    return {
        "redis_url": request.getfixturevalue("redis_url"),
        "namespace": f"t_{uuid.uuid4().hex[:12]}",
    }


async def _forget(locks: dict[str, Any]) -> None:
    """Deletes the Redis keys of a distributed run's namespace."""
    if not locks:
        return
    import redis.asyncio

    client = redis.asyncio.from_url(locks["redis_url"])
    try:
        pattern = f"flowlock:{locks['namespace']}:*"
        keys = [key async for key in client.scan_iter(match=pattern, count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def _capacity_storm(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: SqlHistory,
    *,
    strategy: str,
    keys: Sequence[str],
    instances: int,
    callers: int,
    seconds: float,
    blind: bool = False,
) -> None:
    engine = await _pg_engine(pg_url, pg_schema)
    locks = _locks(request, strategy)
    try:
        ids = await _reviews(engine, instances, keys)
        gate = Gate(tmp_path / "gate", PROCESSES)
        confs = [
            {
                "mode": "storm",
                "url": pg_url,
                "schema": pg_schema,
                "strategy": strategy,
                "proc": p,
                "gate": str(gate),
                "ids": ids,
                "keys": list(keys),
                "callers": callers,
                "seconds": seconds,
                "warm": ids,
                "blind": blind,
                **locks,
            }
            for p in range(PROCESSES)
        ]
        reports = await _run(gate, confs)
        applied, errors = _total(reports, "applied"), _total(reports, "errors")
        print(
            f"{strategy} over {len(keys)} key(s): applied {dict(applied)}, refused {dict(errors)}"
        )
        assert set(errors) <= EXPECTED, [r["samples"] for r in reports]
        # The storm pressed on the limit: slots were taken and given back, and keys were full.
        assert applied["start"] > 0 and applied["finish"] > 0, applied
        assert errors["CapacityReached"] > 0, errors
        assert [odd for r in reports for odd in r["odd"]] == []

        rows = await read_pg(pg_url, pg_schema)
        proof = slot_proof(rows, REVIEW_KIND, LIMIT, key_of=_reviewer)
        proof.assert_ok()
        assert max(proof.peak.values()) == LIMIT, proof.peak
        assert proof.takes >= applied["start"], (proof.takes, applied)
        # Every process took slots and was refused some: the keys' slots were shared among
        # the processes, a key full with holders that more than one of them put there.
        assert all(r["applied"].get("start") for r in reports), reports
        assert all(r["errors"].get("CapacityReached") for r in reports), reports
        assert proof.mixed_full > 0, proof
        if blind:  # commits of several entries (one transaction: one now()) took place
            [batched] = await _sql(
                pg_url, pg_schema,
                "SELECT count(*) AS n FROM (SELECT instance_id, at FROM flowlock_history"
                " GROUP BY instance_id, at HAVING count(*) > 1) AS batches",
            )  # fmt: skip
            print(f"{batched['n']} commits of a batch")
            assert batched["n"] > 0
        await _checked(engine, pg_url, pg_schema, rows)
        (await sql_history()).assert_matches({iid: await engine.history(iid) for iid in ids})

        # The checks read these very rows: one slot row deleted behind flowlock's back (a
        # holder in review without its slot) fails both the checker and the replay.
        [holder] = await _sql(
            pg_url, pg_schema,
            "DELETE FROM flowlock_slots WHERE (kind, instance_id) IN (SELECT kind, instance_id"
            " FROM flowlock_slots LIMIT 1) RETURNING instance_id",
        )  # fmt: skip
        broken = await check_instances(engine, None)
        assert not broken.verdict.ok
        assert holder["instance_id"] in broken.verdict.describe()
        assert slot_proof(await read_pg(pg_url, pg_schema), REVIEW_KIND, LIMIT).problems
    finally:
        await engine.aclose()
        await _forget(locks)


async def test_capacity_storm_across_processes_quick(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: SqlHistory,
) -> None:
    """4 processes x 3 callers move 16 reviews over 2 reviewers of capacity 5 in and out of
    review for 0.7 s, optimistic: no key ever above 5 holders (the slot log replayed), the
    slot rows equal the counters and the instances in review, the checker is clean."""
    await _capacity_storm(
        request, pg_url, pg_schema, tmp_path, sql_history,
        strategy="optimistic", keys=["ann", "bob"], instances=16, callers=3, seconds=0.7,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("keys", [["ann", "bob", "cid"], ["ann"]], ids=["3-keys", "1-key"])
async def test_capacity_storm_across_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: SqlHistory,
    strategy: str,
    keys: list[str],
) -> None:
    """4 processes x 8 callers move 48 reviews in and out of review (and between reviewers)
    for 4 seconds, over 3 reviewers or all on one, under each strategy: every key reached 5
    holders and never more (the slot log replayed), the slot rows equal the counters and the
    instances in review, every take and release is a history row, the checker is clean."""
    await _capacity_storm(
        request, pg_url, pg_schema, tmp_path, sql_history,
        strategy=strategy, keys=keys, instances=48, callers=8, seconds=4.0,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_capacity_storm_of_batched_calls_across_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: SqlHistory,
    strategy: str,
) -> None:
    """4 processes x 8 callers fire starts and finishes unread at 10 reviews of one reviewer
    for 3 seconds, so that each process batches the calls on an instance (a batch's takes and
    releases in one commit) while the others do the same: never more than 5 holders, the slot
    rows equal the counters and the instances in review, the checker is clean."""
    await _capacity_storm(
        request, pg_url, pg_schema, tmp_path, sql_history,
        strategy=strategy, keys=["ann"], instances=10, callers=8, seconds=3.0, blind=True,
    )  # fmt: skip


# -- kill -9 in the middle of a take ---------------------------------------------------------

VICTIM = "procs-victim"
STALL = 3.0  # seconds the victim's takes sleep inside their transaction

_STALL_SQL = f"""
CREATE FUNCTION procs_stall() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('application_name') = '{VICTIM}' THEN
        PERFORM pg_sleep({STALL});
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER procs_stall AFTER INSERT ON flowlock_slot_log
    FOR EACH ROW EXECUTE FUNCTION procs_stall();
"""


async def _sql(pg_url: str, pg_schema: str, sql: str, *args: Any) -> Any:
    conn = await pg_budget.connect(pg_url)
    try:
        await conn.execute(f'SET search_path TO "{pg_schema}"')
        if sql.lstrip().upper().startswith("SELECT") or "RETURNING" in sql:
            return await conn.fetch(sql, *args)
        return await conn.execute(sql, *args)
    finally:
        await conn.close()


def _phase(gate: Gate, proc: int) -> Phase:
    raw = json.loads((gate.path / f"phase-{proc}.json").read_text())
    return Phase(raw["proc"], raw["start"], raw["end"])


async def _until(probe: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await probe():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        await asyncio.sleep(0.05)


async def _victim_sessions(pg_url: str, pg_schema: str, where: str = "true") -> int:
    rows = await _sql(
        pg_url,
        pg_schema,
        f"SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = $1 AND {where}",
        VICTIM,
    )
    return int(rows[0]["n"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_kill_9_in_the_middle_of_a_take_leaks_no_slot(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory, strategy: str
) -> None:
    """A process is killed with SIGKILL while 3 others storm the same keys and it is in the
    middle of transitions that took a slot: storm takes held inside their statement by a
    trigger, and two starts (of two other reviewers) inside transactions of its own, not yet
    committed. Afterwards the two held reviews are still queued with no history and no slot,
    the slot rows equal the instances in review and the counters, the log replays clean, and
    every reviewer's 5 slots can be taken again, no more (no slot leaked)."""
    keys = ["ann", "bob", "cid"]
    engine = await _pg_engine(pg_url, pg_schema)
    try:
        ids = await _reviews(engine, 48, keys)
        # Two more reviewers, 6 reviews each, out of the storm: the victim starts the first of
        # each inside a transaction of its own and never commits; then their 5 slots must be
        # free (no slot leaked): 5 of the 6 get in, the sixth is refused.
        spare = {"dan": [f"dan-{n}" for n in range(6)], "eve": [f"eve-{n}" for n in range(6)]}
        for reviewer, names in spare.items():
            for iid in names:
                await engine.create("review", instance_id=iid, data={"reviewer": reviewer})
        hold = [names[0] for names in spare.values()]
        await _sql(pg_url, pg_schema, _STALL_SQL)
        gate = Gate(tmp_path / "gate", PROCESSES)
        base = {
            "mode": "storm", "url": pg_url, "schema": pg_schema, "strategy": strategy,
            "gate": str(gate), "ids": ids, "keys": keys, "callers": 6, "warm": ids,
        }  # fmt: skip
        confs = [{**base, "proc": p, "seconds": 6.0} for p in range(PROCESSES - 1)]
        victim_conf = {"proc": PROCESSES - 1, "seconds": BOUND, "hold": hold}
        confs.append({**base, **victim_conf, "application_name": VICTIM})
        procs = await _spawn(confs)
        victim = procs[-1]
        try:
            await gate.open_when_ready(procs)

            async def in_the_middle() -> bool:
                held = sum((gate.path / f"held-{n}").exists() for n in range(len(hold)))
                if victim.returncode is not None:
                    _, err = await victim.communicate()
                    raise AssertionError(f"the victim exited: {err.decode()[-3000:]}")
                stalled = await _victim_sessions(pg_url, pg_schema, "wait_event = 'PgSleep'")
                return held == len(hold) and stalled >= 1

            await _until(in_the_middle, 30.0, "the victim's takes in the middle of their commit")
            killed_at = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(victim.wait(), timeout=BOUND) == -signal.SIGKILL
            reports = await _reports(procs[:-1])
        finally:
            await _stop(procs)

        async def gone() -> bool:
            return await _victim_sessions(pg_url, pg_schema) == 0

        await _until(gone, STALL + 30.0, "the killed process's sessions ended")
        # The kill fell inside every other process's storm.
        phases = [_phase(gate, p) for p in range(PROCESSES - 1)]
        assert max(p.start for p in phases) < killed_at < min(p.end for p in phases), phases
        errors = _total(reports, "errors")
        assert set(errors) <= EXPECTED, [r["samples"] for r in reports]

        rows = await read_pg(pg_url, pg_schema)
        for iid in hold:  # rolled back whole: no transition, no slot
            assert [(i[2], i[3]) for i in rows.instances if i[0] == iid] == [("queued", 1)]
            assert [h for h in rows.history if h[0] == iid] == []
            assert [s for s in rows.slots if s[2] == iid] == []
        slot_proof(rows, REVIEW_KIND, LIMIT, key_of=_reviewer).assert_ok()
        await _checked(engine, pg_url, pg_schema, rows)
        everyone = [*ids, *(i for names in spare.values() for i in names)]
        (await sql_history()).assert_matches({i: await engine.history(i) for i in everyone})

        # No slot leaked: each reviewer's queued reviews fill its free slots exactly.
        for key in [*keys, *spare]:
            mine = [i for i in everyone if (await engine.get(i)).data["reviewer"] == key]
            for iid in mine:
                if (await engine.get(iid)).state == "queued":
                    with contextlib.suppress(flowlock.CapacityReached):
                        await engine.fire(iid, "start")
            in_review = [i for i in mine if (await engine.get(i)).state == "in_review"]
            assert len(in_review) == min(LIMIT, len(mine)), (key, in_review)
            assert (await engine.capacity(REVIEW_KIND, key)).used == len(in_review)
        refilled = await read_pg(pg_url, pg_schema)
        slot_proof(refilled, REVIEW_KIND, LIMIT, key_of=_reviewer).assert_ok()
        assert Counter(s[1] for s in refilled.slots) == dict.fromkeys([*keys, *spare], LIMIT)
    finally:
        await engine.aclose()


# -- waiting for a slot, woken by another process's release ---------------------------------


async def _desks(
    engine: flowlock.Engine, gate: Gate, processes: int, where: dict[str, Any]
) -> list[dict[str, Any]]:
    """`engine` takes all 5 seats of desk d1; `processes` workers x 4 callers ask for seats
    (waiting), and once every worker is in its phase (and a second more), `engine` gives its
    seats back. The workers' reports, once their phases overlapped."""
    holders = [f"hold-{n}" for n in range(LIMIT)]
    for iid in holders:
        await engine.create("desk", instance_id=iid, data={"desk": "d1"})
        await engine.fire(iid, "take")
    confs = []
    for p in range(processes):
        ids = [f"w{p}-{n}" for n in range(4)]
        for iid in ids:
            await engine.create("desk", instance_id=iid, data={"desk": "d1"})
        confs.append({**where, "mode": "desks", "proc": p, "gate": str(gate), "ids": ids,
                      "rounds": 5, "warm": ids})  # fmt: skip
    procs = await _spawn(confs)
    try:
        await gate.open_when_ready(procs)

        async def all_started() -> bool:
            return all((gate.path / f"started-{p}").exists() for p in range(processes))

        await _until(all_started, BOUND, "every worker in its phase")
        await asyncio.sleep(1.0)  # their first takes are refused and wait
        assert (await engine.capacity(DESK_KIND, "d1")).holders == tuple(holders)
        for iid in holders:
            await engine.fire(iid, "leave")
        reports = await _reports(procs)
    finally:
        await _stop(procs)
    gate.assert_overlapped()
    applied, errors = _total(reports, "applied"), _total(reports, "errors")
    waited = max(r["waited"] for r in reports)
    run = f"{where.get('backend', 'postgres')} {where['strategy']}"
    print(f"desks {run}: applied {dict(applied)}, errors {dict(errors)}, {waited=:.2f}")
    assert errors == {}, [r["samples"] for r in reports]
    assert applied == {"take": processes * 4 * 5, "leave": processes * 4 * 5}, applied
    return reports


def _desk_proof(rows: Rows) -> None:
    """Never more than 5 seated, all free at the end, shared by processes, and no worker
    seated before the first seat the test's engine gave back."""
    proof = slot_proof(
        rows, DESK_KIND, LIMIT, workflow="desk", key_of=lambda d: d["desk"],
        states=("busy",), takes=("take",), releases=("leave",), must_take=("take",),
        must_release=("leave",),
    )  # fmt: skip
    proof.assert_ok()
    assert proof.peak == {"d1": LIMIT} and proof.holders == {}, proof
    assert proof.mixed_full > 0, proof
    log = [e for e in rows.log if e[0] == DESK_KIND]
    first_release = next(e[2] for e in log if e[3].startswith("hold-") and e[5] == -1)
    assert all(e[2] > first_release for e in log if e[3].startswith("w")), log[:12]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_waiters_in_four_processes_are_woken_by_another_process(
    pg_url: str, pg_schema: str, tmp_path: Path, strategy: str
) -> None:
    """The test's own engine holds all 5 seats of a desk while 4 processes x 4 callers ask for
    one with Capacity(wait=30): they wait, and once it gives its seats back (a release they can
    only hear from the database) every take gets in, none before the first release, 5 rounds
    each, never more than 5 seated."""
    engine = await _pg_engine(pg_url, pg_schema)
    try:
        where = {"url": pg_url, "schema": pg_schema, "strategy": strategy}
        await _desks(engine, Gate(tmp_path / "gate", PROCESSES), PROCESSES, where)
        rows = await read_pg(pg_url, pg_schema)
        _desk_proof(rows)
        await _checked(engine, pg_url, pg_schema, rows)
    finally:
        await engine.aclose()


@pytest.mark.slow
async def test_waiters_on_a_sqlite_file_are_woken_by_another_process(tmp_path: Path) -> None:
    """The same on one SQLite file with 3 processes (a release made by another process is
    seen by the store's periodic look, there is no notice to hear): every take gets in."""
    path = tmp_path / "flowlock.db"
    async with flowlock.Engine(SqliteStore(path, pool_size=2)) as engine:
        for wf in workflows():
            await engine.register(wf)
        where = {"backend": "sqlite", "path": str(path), "strategy": "optimistic"}
        await _desks(engine, Gate(tmp_path / "gate", 3), 3, where)
        rows = read_sqlite(str(path))
        _desk_proof(rows)
        await _checked(engine, f"sqlite:///{path}", None, rows)


# -- uniqueness ------------------------------------------------------------------------------


def _unique_proof(rows: Any) -> Any:
    return slot_proof(
        rows,
        UNIQUE_KIND,
        1,
        workflow="subscription",
        key_of=lambda data: data["customer_id"],
        states=("active", "suspended"),
        takes=("create", "resume"),
        releases=("cancel",),
        must_take=(),
        must_release=("cancel",),
    )


@pytest.mark.slow
async def test_one_of_100_concurrent_creates_for_one_customer_wins(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """100 subscriptions of one customer created at once by 4 processes x 25 tasks: exactly
    one is created, the 99 others raise UniqueViolation naming it; one slot row, one log event;
    once it is cancelled, the next create for the customer succeeds."""
    engine = await _pg_engine(pg_url, pg_schema)
    try:
        gate = Gate(tmp_path / "gate", PROCESSES)
        confs = [
            {
                "mode": "unique",
                "url": pg_url,
                "schema": pg_schema,
                "proc": p,
                "gate": str(gate),
                "customer": "c-42",
                "tasks": 25,
                "ids": [f"s{p}-{n:02}" for n in range(25)],
            }
            for p in range(PROCESSES)
        ]
        reports = await _run(gate, confs)
        answers = {iid: a for r in reports for iid, a in r["answers"].items()}
        assert len(answers) == 100
        created = [iid for iid, a in answers.items() if "created" in a]
        assert len(created) == 1, created
        [holder] = created
        refused = [a for a in answers.values() if "created" not in a]
        assert {a["error"] for a in refused} == {"UniqueViolation"}, refused[:3]
        assert {(a["holder"], a["kind"], a["key"]) for a in refused} == {
            (holder, UNIQUE_KIND, "c-42")
        }
        assert all(holder in a["message"] for a in refused)

        rows = await read_pg(pg_url, pg_schema)
        assert [(i[0], i[2]) for i in rows.instances] == [(holder, "active")]
        assert [(s[1], s[2]) for s in rows.slots if s[0] == UNIQUE_KIND] == [("c-42", holder)]
        _unique_proof(rows).assert_ok()
        assert [(e[3], e[4], e[5]) for e in rows.log] == [(holder, 1, 1)]
        await _checked(engine, pg_url, pg_schema, rows)

        await engine.fire(holder, "cancel")
        customer = {"customer_id": "c-42"}
        again = await engine.create("subscription", instance_id="s-next", data=customer)
        assert again.state == "active"
        with pytest.raises(flowlock.UniqueViolation) as refused_again:
            await engine.create("subscription", instance_id="s-late", data=customer)
        assert refused_again.value.holder == "s-next"
        _unique_proof(await read_pg(pg_url, pg_schema)).assert_ok()
        await _checked(engine, pg_url, pg_schema)
        (await sql_history()).assert_matches(
            {iid: await engine.history(iid) for iid in (holder, "s-next")}
        )
    finally:
        await engine.aclose()


# -- a rate limit ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_rate_limit_holds_across_two_processes(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: SqlHistory
) -> None:
    """2 processes x 6 callers ping 10 instances of one sku (20 per second) for 3 seconds: in
    the rate log no window of one second holds more than 20 and some hold exactly 20; every
    applied ping is logged once; the refused calls got RateLimited with a retry_after in
    (0, 1] s."""
    engine = await _pg_engine(pg_url, pg_schema)
    try:
        ids = [f"t{n:02}" for n in range(10)]
        for iid in ids:
            await engine.create("throttle", instance_id=iid, data={"sku": "sku-1"})
        gate = Gate(tmp_path / "gate", 2)
        confs = [
            {
                "mode": "rate",
                "url": pg_url,
                "schema": pg_schema,
                "proc": p,
                "gate": str(gate),
                "ids": ids,
                "callers": 6,
                "seconds": 3.0,
                "warm": ids,
                "strategy": "optimistic",
            }
            for p in range(2)
        ]
        reports = await _run(gate, confs)
        applied, errors = _total(reports, "applied"), _total(reports, "errors")
        print(f"rate: applied {dict(applied)}, refused {dict(errors)}")
        assert set(errors) <= {"RateLimited", "ConflictRetriesExhausted"}, [
            r["samples"] for r in reports
        ]
        assert errors["RateLimited"] > 0 and all(r["applied"] for r in reports), reports
        lows = [r["retry_after"][0] for r in reports if r["errors"].get("RateLimited")]
        highs = [r["retry_after"][1] for r in reports if r["errors"].get("RateLimited")]
        assert min(lows) > 0 and max(highs) <= RATE_PER, (lows, highs)

        rows = await read_pg(pg_url, pg_schema)
        proof = rate_proof(rows, THROTTLE_KIND, RATE, RATE_PER)
        proof.assert_ok()
        assert proof.events == applied["ping"] == len(rows.history), (proof, applied)
        assert proof.busiest == {"sku-1": RATE}, proof.busiest
        await _checked(engine, pg_url, pg_schema, rows)
        (await sql_history()).assert_matches({iid: await engine.history(iid) for iid in ids})
    finally:
        await engine.aclose()


# -- SQLite: one file, several processes -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_capacity_storm_on_a_sqlite_file_across_processes(
    tmp_path: Path, strategy: str
) -> None:
    """3 processes x 4 callers move 24 reviews over 2 reviewers in and out of review on one
    SQLite file for 3 seconds: no key ever above 5 holders (the slot log replayed), the slot
    rows equal the counters and the instances in review, the checker is clean."""
    path = tmp_path / "flowlock.db"
    keys = ["ann", "bob"]
    async with flowlock.Engine(SqliteStore(path, pool_size=2)) as engine:
        for wf in workflows():
            await engine.register(wf)
        ids = await _reviews(engine, 24, keys)
        gate = Gate(tmp_path / "gate", 3)
        confs = [
            {
                "mode": "storm",
                "backend": "sqlite",
                "path": str(path),
                "strategy": strategy,
                "proc": p,
                "gate": str(gate),
                "ids": ids,
                "keys": keys,
                "callers": 4,
                "seconds": 3.0,
                "warm": ids,
            }
            for p in range(3)
        ]
        reports = await _run(gate, confs)
        applied, errors = _total(reports, "applied"), _total(reports, "errors")
        print(f"sqlite {strategy}: applied {dict(applied)}, refused {dict(errors)}")
        assert set(errors) <= EXPECTED, [r["samples"] for r in reports]
        assert applied["start"] > 0 and errors["CapacityReached"] > 0, (applied, errors)
        assert [odd for r in reports for odd in r["odd"]] == []
        rows = read_sqlite(str(path))
        proof = slot_proof(rows, REVIEW_KIND, LIMIT, key_of=_reviewer)
        proof.assert_ok()
        assert max(proof.peak.values()) == LIMIT, proof.peak
        await _checked(engine, f"sqlite:///{path}", None, rows)
