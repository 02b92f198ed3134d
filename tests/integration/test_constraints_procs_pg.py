"""Capacities, uniqueness and rate limits across OS processes sharing one database.

The workers (constraint_worker.py, started by constraint_procs.py) start together through a
gate and every test shows that their contended phases overlapped. Then the database is read
with the tests' own SQL (constraint_kit): each key's slot log replayed +1 / -1 in seq order
never holds more than the limit, the slot rows per key equal the counter and the instances in
the state, the rate log never holds more than the limit in any window; and the exactly-once
checker (in the engine, and as the command `flowlock check`) reads the whole database clean.
Kills and waits: test_constraints_faults_procs_pg.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import constraint_procs as cp
import pytest
from constraint_procs import Db
from proc_worker import Gate

import flowlock
from constraint_kit import (
    LIMIT,
    RATE,
    RATE_PER,
    REVIEW_KIND,
    THROTTLE_KIND,
    UNIQUE_KIND,
    rate_proof,
    read_pg,
    read_sqlite,
    slot_proof,
    workflows,
)
from flowlock._inspect import check_instances
from flowlock.stores.sqlite import SqliteStore

_AUDIT = "CREATE TABLE audit (instance_id text, version bigint, event text)"


async def _capacity_storm(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
    *,
    strategy: str,
    keys: Sequence[str],
    instances: int,
    callers: int,
    seconds: float,
    blind: bool = False,
    swap: bool = False,
    in_transaction: bool = False,
) -> None:
    engine = await cp.pg_engine(pg_url, pg_schema)
    locks = cp.redis_locks(request, strategy)
    try:
        ids = await cp.make_reviews(engine, instances, keys)
        if in_transaction:  # the application's own table, written in the same transactions
            await cp.sql(pg_url, pg_schema, _AUDIT)
        gate = Gate(tmp_path / "gate", cp.PROCESSES)
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
                "swap": swap,
                "in_transaction": in_transaction,
                "pool_size": 2 if in_transaction else 4,
                **locks,
            }
            for p in range(cp.PROCESSES)
        ]
        reports = await cp.run_through_gate(gate, confs)
        applied, errors = cp.total(reports, "applied"), cp.total(reports, "errors")
        print(
            f"{strategy} over {len(keys)} key(s): applied {dict(applied)}, refused {dict(errors)}"
        )
        assert set(errors) <= cp.EXPECTED, [r["samples"] for r in reports]
        assert [odd for r in reports for odd in r["odd"]] == []
        rows = await read_pg(pg_url, pg_schema)
        proof = slot_proof(rows, REVIEW_KIND, LIMIT, key_of=cp.reviewer)
        proof.assert_ok()
        assert proof.takes >= applied["start"], (proof.takes, applied)
        for key in keys:  # engine.capacity names the holders the rows hold, oldest first
            usage = await engine.capacity(REVIEW_KIND, key)
            took = {e[3]: e[2] for e in rows.log if e[:2] == (REVIEW_KIND, key) and e[5] == 1}
            held = sorted((took[s[2]], s[2]) for s in rows.slots if s[:2] == (REVIEW_KIND, key))
            assert (usage.limit, list(usage.holders)) == (LIMIT, [i for _, i in held]), usage
        if in_transaction:  # an audit row exactly where a transition committed
            audit = await cp.sql(pg_url, pg_schema, "SELECT instance_id, version, event FROM audit")
            assert sorted(tuple(a) for a in audit) == sorted(h[:3] for h in rows.history)
        if swap:  # every process moved reviews between reviewers
            assert all(r["applied"].get("reassign") for r in reports), reports
        else:
            # The storm pressed on the limit: slots were taken and given back, keys were full,
            # every process took slots and was refused some, and a key was full with holders
            # that more than one process put there.
            assert applied["start"] > 0 and applied["finish"] > 0, applied
            assert max(proof.peak.values()) == LIMIT, proof.peak
            assert all(r["applied"].get("start") for r in reports), reports
            assert all(r["errors"].get("CapacityReached") for r in reports), reports
            assert proof.mixed_full > 0, proof
        if blind:  # commits of several entries (one transaction: one now()) took place
            [batched] = await cp.sql(
                pg_url, pg_schema,
                "SELECT count(*) AS n FROM (SELECT instance_id, at FROM flowlock_history"
                " GROUP BY instance_id, at HAVING count(*) > 1) AS batches",
            )  # fmt: skip
            print(f"{batched['n']} commits of a batch")
            assert batched["n"] > 0
        await cp.checked(engine, pg_url, pg_schema, rows)
        (await sql_history()).assert_matches({iid: await engine.history(iid) for iid in ids})

        # The checks read these very rows: one slot row deleted behind flowlock's back (a
        # holder in review without its slot) fails both the checker and the replay.
        [holder] = await cp.sql(
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
        await cp.forget_locks(locks)


async def test_capacity_storm_across_processes_quick(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
) -> None:
    """4 processes x 3 callers move 16 reviews over 2 reviewers of capacity 5 in and out of
    review for 0.7 s, optimistic: no key ever above 5 holders (the slot log replayed), the
    slot rows equal the counters and the instances in review, the checker is clean."""
    await _capacity_storm(
        request, pg_url, pg_schema, tmp_path, sql_history,
        strategy="optimistic", keys=["ann", "bob"], instances=16, callers=3, seconds=0.7,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("strategy", cp.STRATEGIES)
@pytest.mark.parametrize("keys", [["ann", "bob", "cid"], ["ann"]], ids=["3-keys", "1-key"])
async def test_capacity_storm_across_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
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
@pytest.mark.parametrize("strategy", cp.TWO)
async def test_capacity_storm_of_batched_calls_across_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
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


@pytest.mark.slow
@pytest.mark.parametrize("strategy", cp.TWO)
async def test_slots_swapped_between_keys_across_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
    strategy: str,
) -> None:
    """4 processes x 8 callers keep moving 12 reviews between 3 reviewers (each move gives
    one key's slot back and takes another's in one commit, in every direction at once) for 3
    seconds: no deadlock or other error but refusals, never more than 5 holders a key, the
    slot rows equal the counters and the instances in review, the checker is clean."""
    await _capacity_storm(
        request, pg_url, pg_schema, tmp_path, sql_history,
        strategy=strategy, keys=["ann", "bob", "cid"], instances=12, callers=8, seconds=3.0,
        swap=True,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("strategy", cp.TWO)
async def test_capacity_storm_inside_the_applications_transactions_across_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
    strategy: str,
) -> None:
    """4 processes x 6 callers fire every move inside a transaction of the application's own
    (fire(connection=)) that writes an audit row when it applied, for 3 seconds over 2
    reviewers: never more than 5 holders, the slot rows equal the counters and the instances
    in review, an audit row for exactly each committed transition, the checker is clean."""
    await _capacity_storm(
        request, pg_url, pg_schema, tmp_path, sql_history,
        strategy=strategy, keys=["ann", "bob"], instances=24, callers=6, seconds=3.0,
        in_transaction=True,
    )  # fmt: skip


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


async def _unique_wave(engine: flowlock.Engine, gate: Gate, where: dict[str, Any], at: Db) -> str:
    """Each worker of `gate` creates 25 subscriptions of customer c-42 at once: exactly one is
    created, the others raise UniqueViolation naming it; one slot row, one log event. Once it
    is cancelled, the next create for the customer succeeds and the one after is refused."""
    confs = [
        {**where, "mode": "unique", "proc": p, "gate": str(gate), "customer": "c-42",
         "tasks": 25, "ids": [f"s{p}-{n:02}" for n in range(25)]}
        for p in range(gate.processes)
    ]  # fmt: skip
    reports = await cp.run_through_gate(gate, confs)
    answers = {iid: a for r in reports for iid, a in r["answers"].items()}
    assert len(answers) == 25 * gate.processes
    created = [iid for iid, a in answers.items() if "created" in a]
    assert len(created) == 1, created
    [holder] = created
    refused = [a for a in answers.values() if "created" not in a]
    assert {a["error"] for a in refused} == {"UniqueViolation"}, refused[:3]
    assert {(a["holder"], a["kind"], a["key"]) for a in refused} == {(holder, UNIQUE_KIND, "c-42")}
    assert all(holder in a["message"] for a in refused)

    rows = await at.rows()
    assert [(i[0], i[2]) for i in rows.instances] == [(holder, "active")]
    assert [(s[1], s[2]) for s in rows.slots if s[0] == UNIQUE_KIND] == [("c-42", holder)]
    _unique_proof(rows).assert_ok()
    assert [(e[3], e[4], e[5]) for e in rows.log] == [(holder, 1, 1)]
    await cp.checked(engine, at.url, at.schema, rows)

    await engine.fire(holder, "cancel")
    customer = {"customer_id": "c-42"}
    again = await engine.create("subscription", instance_id="s-next", data=customer)
    assert again.state == "active"
    with pytest.raises(flowlock.UniqueViolation) as refused_again:
        await engine.create("subscription", instance_id="s-late", data=customer)
    assert refused_again.value.holder == "s-next"
    _unique_proof(await at.rows()).assert_ok()
    await cp.checked(engine, at.url, at.schema)
    return str(holder)


@pytest.mark.slow
async def test_one_of_100_concurrent_creates_for_one_customer_wins(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: cp.SqlHistory
) -> None:
    """100 subscriptions of one customer created at once by 4 processes x 25 tasks: exactly
    one is created, the 99 others raise UniqueViolation naming it; one slot row, one log event;
    once it is cancelled, the next create for the customer succeeds."""
    engine = await cp.pg_engine(pg_url, pg_schema)
    try:
        where = {"url": pg_url, "schema": pg_schema}
        at = Db.pg(pg_url, pg_schema)
        holder = await _unique_wave(engine, Gate(tmp_path / "gate", cp.PROCESSES), where, at)
        (await sql_history()).assert_matches(
            {iid: await engine.history(iid) for iid in (holder, "s-next")}
        )
    finally:
        await engine.aclose()


@pytest.mark.slow
async def test_one_of_75_concurrent_creates_on_a_sqlite_file_wins(tmp_path: Path) -> None:
    """The same on one SQLite file, 3 processes x 25 tasks: exactly one created, the others
    refused naming it."""
    path = tmp_path / "flowlock.db"
    async with flowlock.Engine(SqliteStore(path, pool_size=2)) as engine:
        for wf in workflows():
            await engine.register(wf)
        where = {"backend": "sqlite", "path": str(path)}
        await _unique_wave(engine, Gate(tmp_path / "gate", 3), where, Db.lite(path))


@pytest.mark.slow
async def test_creates_and_cancels_of_one_customer_across_processes_never_overlap(
    pg_url: str, pg_schema: str, tmp_path: Path, sql_history: cp.SqlHistory
) -> None:
    """4 processes x 4 callers keep creating subscriptions of one customer for 3 seconds, each
    one created cancelled a moment later: the unique slot log never shows two holders, every
    create that succeeded took the slot and its cancel gave it back, every refusal named
    another subscription, and none is left active."""
    engine = await cp.pg_engine(pg_url, pg_schema)
    try:
        gate = Gate(tmp_path / "gate", cp.PROCESSES)
        confs = [
            {"mode": "churn", "url": pg_url, "schema": pg_schema, "proc": p,
             "gate": str(gate), "customer": "c-7", "callers": 4, "seconds": 3.0}
            for p in range(cp.PROCESSES)
        ]  # fmt: skip
        reports = await cp.run_through_gate(gate, confs)
        applied, errors = cp.total(reports, "applied"), cp.total(reports, "errors")
        print(f"churn: applied {dict(applied)}, refused {dict(errors)}")
        assert set(errors) == {"UniqueViolation"}, [r["samples"] for r in reports]
        assert [odd for r in reports for odd in r["odd"]] == []
        assert applied["create"] == applied["cancel"] > 1, applied
        assert sum(1 for r in reports if r["applied"].get("create")) > 1, reports

        rows = await read_pg(pg_url, pg_schema)
        proof = _unique_proof(rows)
        proof.assert_ok()
        assert proof.peak == {"c-7": 1} and proof.holders == {}, proof
        assert proof.takes == applied["create"], (proof.takes, applied)
        assert {i[2] for i in rows.instances} == {"cancelled"}
        assert len(rows.instances) == applied["create"]
        await cp.checked(engine, pg_url, pg_schema, rows)
        (await sql_history()).assert_matches(
            {i[0]: await engine.history(i[0]) for i in rows.instances}
        )
    finally:
        await engine.aclose()


# -- a rate limit ----------------------------------------------------------------------------


async def _rate_run(
    engine: flowlock.Engine, gate: Gate, where: dict[str, Any], at: Db
) -> list[str]:
    """The workers of `gate`, 6 callers each, ping 10 instances of sku-1 (20 per second) for 3
    seconds: no window of a second in the rate log holds more than 20 and some hold 20; every
    applied ping is logged once; refusals are RateLimited with a retry_after in (0, 1] s."""
    ids = [f"t{n:02}" for n in range(10)]
    for iid in ids:
        await engine.create("throttle", instance_id=iid, data={"sku": "sku-1"})
    confs = [
        {"strategy": "optimistic", **where, "mode": "rate", "proc": p, "gate": str(gate),
         "ids": ids, "callers": 6, "seconds": 3.0, "warm": ids}
        for p in range(gate.processes)
    ]  # fmt: skip
    reports = await cp.run_through_gate(gate, confs)
    applied, errors = cp.total(reports, "applied"), cp.total(reports, "errors")
    print(f"rate: applied {dict(applied)}, refused {dict(errors)}")
    assert set(errors) <= {"RateLimited", "ConflictRetriesExhausted"}, [
        r["samples"] for r in reports
    ]
    assert errors["RateLimited"] > 0 and all(r["applied"] for r in reports), reports
    lows = [r["retry_after"][0] for r in reports if r["errors"].get("RateLimited")]
    highs = [r["retry_after"][1] for r in reports if r["errors"].get("RateLimited")]
    assert min(lows) > 0 and max(highs) <= RATE_PER, (lows, highs)

    rows = await at.rows()
    proof = rate_proof(rows, THROTTLE_KIND, RATE, RATE_PER)
    proof.assert_ok()
    assert proof.events == applied["ping"] == len(rows.history), (proof, applied)
    assert proof.busiest == {"sku-1": RATE}, proof.busiest
    await cp.checked(engine, at.url, at.schema, rows)
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("strategy", cp.TWO)
async def test_a_rate_limit_holds_across_two_processes(
    request: pytest.FixtureRequest,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    sql_history: cp.SqlHistory,
    strategy: str,
) -> None:
    """2 processes x 6 callers ping 10 instances of one sku (20 per second) for 3 seconds,
    under each strategy: in the rate log no window of one second holds more than 20 and some
    hold exactly 20; every applied ping is logged once; the refused calls got RateLimited with
    a retry_after in (0, 1] s."""
    engine = await cp.pg_engine(pg_url, pg_schema)
    locks = cp.redis_locks(request, strategy)
    try:
        where = {"url": pg_url, "schema": pg_schema, "strategy": strategy, **locks}
        at = Db.pg(pg_url, pg_schema)
        ids = await _rate_run(engine, Gate(tmp_path / "gate", 2), where, at)
        (await sql_history()).assert_matches({iid: await engine.history(iid) for iid in ids})
    finally:
        await engine.aclose()
        await cp.forget_locks(locks)


@pytest.mark.slow
async def test_a_rate_limit_holds_across_two_processes_on_a_sqlite_file(tmp_path: Path) -> None:
    """The same on one SQLite file (its store's clock times the pings): never more than 20 in
    a window of one second."""
    path = tmp_path / "flowlock.db"
    async with flowlock.Engine(SqliteStore(path, pool_size=2)) as engine:
        for wf in workflows():
            await engine.register(wf)
        where = {"backend": "sqlite", "path": str(path)}
        await _rate_run(engine, Gate(tmp_path / "gate", 2), where, Db.lite(path))


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
        ids = await cp.make_reviews(engine, 24, keys)
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
        reports = await cp.run_through_gate(gate, confs)
        applied, errors = cp.total(reports, "applied"), cp.total(reports, "errors")
        print(f"sqlite {strategy}: applied {dict(applied)}, refused {dict(errors)}")
        assert set(errors) <= cp.EXPECTED, [r["samples"] for r in reports]
        assert applied["start"] > 0 and errors["CapacityReached"] > 0, (applied, errors)
        assert [odd for r in reports for odd in r["odd"]] == []
        rows = read_sqlite(str(path))
        proof = slot_proof(rows, REVIEW_KIND, LIMIT, key_of=cp.reviewer)
        proof.assert_ok()
        assert max(proof.peak.values()) == LIMIT, proof.peak
        await cp.checked(engine, f"sqlite:///{path}", None, rows)
