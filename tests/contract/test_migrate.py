"""Migrating instances to another definition version on every store (memory, SQLite,
PostgreSQL): the `migrated` row, the state map and the data function, the refusal before
writing, the dry run, a rerun that resumes, DefinitionMismatch; and the checker's
definition-version rules, the sync twin, the HTTP problem and `flowlock admin migrate` through
typer's runner (SQLite)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import flowlock
from flowlock import Transition, Workflow
from flowlock.checker import DEFINITION_VERSION, check, check_many
from flowlock.checker.verdicts import REPAIR_ROW
from flowlock.cli import app as cli
from flowlock.core.bulk import bulk_request_id
from flowlock.core.migration import MigrationMove, migration_payload
from flowlock.core.models import HistoryEntry, Instance
from flowlock.core.versions import canonical
from flowlock.stores import MemoryStore, Store
from lock_probes import wait_until
from migrate_kit import MAP, TICKET, ran_under_own_version, ticket_v1, ticket_v2

StoreFactory = Callable[..., Store]


@pytest.fixture
async def engine(store_factory: StoreFactory) -> AsyncIterator[flowlock.Engine]:
    """An engine of both versions on each store (memory, SQLite, PostgreSQL)."""
    async with flowlock.Engine(store_factory()) as eng:
        assert await eng.register(ticket_v1()) == 1
        assert await eng.register(ticket_v2()) == 2
        yield eng


async def _make(engine: flowlock.Engine, n: int, version: int = 1, prefix: str = "t") -> list[str]:
    ids = [f"{prefix}-{i:03d}" for i in range(n)]
    for iid in ids:
        await engine.create(TICKET, instance_id=iid, data={"n": 0}, version=version)
    return ids


async def _rows(engine: flowlock.Engine, ids: list[str]) -> dict[str, list[HistoryEntry]]:
    return {iid: await engine.history(iid) for iid in ids}


async def _clean(engine: flowlock.Engine, ids: list[str]) -> None:
    pairs = [(await engine.get(i), await engine.history(i)) for i in ids]
    # Each row held to the stored rules of the version it records, too.
    forms = {d.version: d.definition for d in await engine.definitions(TICKET)}
    verdict = check_many(pairs, definitions={TICKET: forms} if forms else None)
    assert verdict.ok, verdict.violations
    for _, rows in pairs:
        assert ran_under_own_version(rows) == []


# -- the run -----------------------------------------------------------------------------------


async def test_each_instance_gets_one_migrated_row_and_runs_the_target_version(
    engine: flowlock.Engine,
) -> None:
    """Every instance moves to its mapped state under version 2, one `migrated` row each."""
    ids = await _make(engine, 6)
    for iid in ids[3:5]:
        await engine.fire(iid, "hold")
    await engine.fire(ids[5], "close")
    await engine.fire(ids[0], "bump")
    report = await engine.migrate(TICKET, 2, state_map=MAP, actor="ops")
    assert (report.matched, report.applied, report.skipped, dict(report.failed)) == (6, 6, 0, {})
    assert report.ok and not report.dry_run and report.seconds > 0
    assert set(report.moves) == {
        MigrationMove(1, "open", "active", 3),
        MigrationMove(1, "held", "held", 2),
        MigrationMove(1, "closed", "done", 1),
    }
    states = {iid: (await engine.get(iid)).state for iid in ids}
    assert states == dict(zip(ids, ["active"] * 3 + ["held"] * 2 + ["done"], strict=True))
    for iid, rows in (await _rows(engine, ids)).items():
        last = rows[-1]
        assert [r.migrated for r in rows].count(True) == 1, iid
        assert (last.kind, last.definition_version, last.actor) == ("migrated", 2, "ops")
        assert last.payload == migration_payload(2, MAP)
        assert last.request_id == bulk_request_id(report.operation_id, iid)
        assert (await engine.get(iid)).definition_version == 2
    # From now on the instance runs version 2's rules and code.
    outcome = await engine.fire(ids[0], "bump")
    assert outcome.instance.data == {"n": 2, "ran": 2}
    assert (await engine.history(ids[0]))[-1].definition_version == 2
    await engine.fire(ids[3], "reopen")  # an event only version 2 has
    await _clean(engine, ids)


async def test_a_migration_under_concurrent_fires_is_exactly_once(
    engine: flowlock.Engine,
) -> None:
    """Callers bump while every instance is migrated: one migrated row each, checker clean."""
    ids = await _make(engine, 30)
    stop = asyncio.Event()
    applied: list[str] = []

    async def caller(k: int) -> None:
        n = 0
        while not stop.is_set():
            iid = ids[(k * 7 + n) % len(ids)]
            n += 1
            outcome = await engine.fire(iid, "bump", request_id=f"c{k}-{n}")
            applied.append(outcome.instance.id)
            await asyncio.sleep(0)

    callers = [asyncio.create_task(caller(k)) for k in range(8)]
    try:
        await wait_until(lambda: len(applied) >= 20, what="the callers' first fires")
        before = len(applied)
        report = await engine.migrate(TICKET, 2, state_map=MAP, batch=7, concurrency=4)
        during = len(applied) - before
        await wait_until(lambda: len(applied) >= before + during + 20, what="fires after")
    finally:
        stop.set()
        await asyncio.gather(*callers)
    assert (report.matched, report.applied, dict(report.failed)) == (30, 30, {})
    assert during > 0, "no fire was applied while the migration ran"
    rows = await _rows(engine, ids)
    assert all([r.migrated for r in h].count(True) == 1 for h in rows.values())
    assert sum(len(h) for h in rows.values()) == len(applied) + 30
    await _clean(engine, ids)


async def test_the_data_function_and_the_selection_apply(engine: flowlock.Engine) -> None:
    """`data` sets each migrated instance's data; `state` and `where` narrow the run."""
    ids = await _make(engine, 6)
    await engine.fire(ids[0], "hold")
    await engine.fire(ids[1], "hold")
    report = await engine.migrate(
        TICKET, 2, state="held", where=lambda i: i.id != ids[1],
        data=lambda i: {**i.data, "from": i.state},
    )  # fmt: skip
    assert (report.matched, report.applied) == (1, 1)
    moved = await engine.get(ids[0])
    assert (moved.definition_version, moved.data) == (2, {"n": 0, "from": "held"})
    assert (await engine.get(ids[1])).definition_version == 1
    assert (await engine.get(ids[2])).definition_version == 1
    await _clean(engine, ids)


async def test_a_stranded_state_refuses_the_run_before_anything_is_written(
    engine: flowlock.Engine,
) -> None:
    """States version 2 lacks, unmapped, refuse the run with their counts; nothing written."""
    ids = await _make(engine, 5)
    await engine.fire(ids[4], "close")
    before = await _rows(engine, ids)
    with pytest.raises(flowlock.MigrationRefused) as refused:
        await engine.migrate(TICKET, 2, state_map={"open": "active"})
    assert refused.value.stranded == {"closed": 1}
    assert "'closed' (1)" in str(refused.value) and "Nothing was written" in str(refused.value)
    with pytest.raises(flowlock.MigrationRefused) as refused:
        await engine.migrate(TICKET, 2)
    assert refused.value.stranded == {"open": 4, "closed": 1}
    assert isinstance(refused.value, flowlock.InvalidInput)
    assert await _rows(engine, ids) == before
    assert {(await engine.get(i)).definition_version for i in ids} == {1}


async def test_the_dry_run_counts_samples_and_strands_but_writes_nothing(
    engine: flowlock.Engine,
) -> None:
    """A dry run reports the moves, a sample and what would be stranded; no row is written."""
    ids = await _make(engine, 4)
    await _make(engine, 2, version=2, prefix="new")
    await engine.fire(ids[0], "close")
    before = await _rows(engine, ids)
    report = await engine.migrate(TICKET, 2, dry_run=True, sample=2)
    assert report.dry_run and (report.matched, report.already, report.applied) == (4, 2, 0)
    assert report.stranded == {"open": 3, "closed": 1} and not report.ok
    assert [i.id for i in report.sample] == ids[:2]
    assert set(report.moves) == {
        MigrationMove(1, "open", "open", 3),
        MigrationMove(1, "closed", "closed", 1),
    }
    mapped = await engine.migrate(TICKET, 2, state_map=MAP, dry_run=True)
    assert mapped.stranded == {} and mapped.operation_id != report.operation_id
    assert json.loads(json.dumps(mapped.summary()))["moves"][0]["from_version"] == 1
    assert await _rows(engine, ids) == before


async def test_a_rerun_after_a_partial_run_resumes(engine: flowlock.Engine) -> None:
    """A run that died after 5 instances, run again, migrates the rest: each exactly once."""
    ids = await _make(engine, 20)

    def crash(done: int) -> None:
        if done == 5:
            raise RuntimeError("the operator's terminal closed")

    with pytest.raises(RuntimeError):
        await engine.migrate(TICKET, 2, state_map=MAP, concurrency=1, progress=crash)
    assert [(await engine.get(i)).definition_version for i in ids].count(2) == 5
    report = await engine.migrate(TICKET, 2, state_map=MAP, concurrency=4)
    assert (report.already, report.matched, report.applied) == (5, 15, 15)
    for iid, rows in (await _rows(engine, ids)).items():
        assert [r.migrated for r in rows].count(True) == 1, iid
    again = await engine.migrate(TICKET, 2, state_map=MAP)
    assert (again.already, again.matched, again.applied) == (20, 0, 0)
    await _clean(engine, ids)


async def test_a_retry_under_the_same_request_id_is_replayed(engine: flowlock.Engine) -> None:
    """The same migration call sent twice writes one row; the second answers the first."""
    (iid,) = await _make(engine, 1)
    rid = bulk_request_id("op-1", iid)
    payload = migration_payload(2, MAP)
    args = ("ops", rid, None, payload, None, None, None)
    first = await engine._fire(iid, flowlock.MIGRATE_EVENT, *args, repair=True)
    second = await engine._fire(iid, flowlock.MIGRATE_EVENT, *args, repair=True)
    assert first.applied and second.replayed and second.instance == first.instance
    assert [r.kind for r in await engine.history(iid)] == ["migrated"]


async def test_a_migration_back_and_forth_is_not_taken_as_done(engine: flowlock.Engine) -> None:
    """Migrated to v2, back to v1, then the first call again: a failure, not a silent replay."""
    (iid,) = await _make(engine, 1)
    assert (await engine.migrate(TICKET, 2, state_map=MAP)).applied == 1
    back = {new: old for old, new in MAP.items()}
    assert (await engine.migrate(TICKET, 1, state_map=back)).applied == 1
    again = await engine.migrate(TICKET, 2, state_map=MAP)
    assert not again.ok and again.replayed == 0 and set(again.failed) == {iid}
    assert "under another operation id" in again.failed[iid]
    assert (await engine.get(iid)).definition_version == 1
    fresh = await engine.migrate(TICKET, 2, state_map=MAP, operation_id="forth-again")
    assert fresh.applied == 1 and (await engine.get(iid)).definition_version == 2


async def test_a_target_version_the_engine_lacks_is_a_definition_mismatch(
    engine: flowlock.Engine, store_factory: StoreFactory
) -> None:
    """Version 3 (not registered) and version 2 in an engine of version 1 only are refused."""
    ids = await _make(engine, 2)
    with pytest.raises(flowlock.DefinitionMismatch) as lacks:
        await engine.migrate(TICKET, 3)
    assert (lacks.value.version, lacks.value.registered) == (3, (1, 2))
    assert str(lacks.value).startswith("cannot migrate workflow 'case' to version 3: this engine")
    with pytest.raises(flowlock.UnknownWorkflow):
        await engine.migrate("nope", 1)
    async with flowlock.Engine(store_factory()) as old:
        await old.register(ticket_v1())
        with pytest.raises(flowlock.DefinitionMismatch):
            await old.migrate(TICKET, 2, state_map=MAP)
        await engine.migrate(TICKET, 2, state_map=MAP)
        # An old engine refuses a migrated instance rather than apply version 1's rules.
        with pytest.raises(flowlock.DefinitionMismatch):
            await old.fire(ids[0], "bump")
        # Read before `old` closes: on memory, it closes the store the two engines share.
        assert [r.kind for r in await engine.history(ids[0])] == ["migrated"]


async def test_bad_arguments_are_refused_before_anything_is_read(
    engine: flowlock.Engine,
) -> None:
    """A map to a state version 2 lacks, a bad version, a non-function: InvalidInput."""
    await _make(engine, 1)
    bad: list[dict[str, Any]] = [
        {"state_map": {"open": "opened"}},
        {"state_map": ["open"]},
        {"data": {"n": 1}},
        {"where": True},
        {"operation_id": "has:colon"},
        {"batch": 0},
    ]
    for kwargs in bad:
        with pytest.raises(flowlock.InvalidInput):
            await engine.migrate(TICKET, 2, **kwargs)
    for version in (0, True, "2"):
        with pytest.raises(flowlock.InvalidInput):
            await engine.migrate(TICKET, version)  # type: ignore[arg-type]


async def test_paused_instances_and_workflows_are_migrated_too(engine: flowlock.Engine) -> None:
    """A migration is an operator's repair: it goes through a pause, which stays."""
    ids = await _make(engine, 2)
    await engine.pause(ids[0], reason="audit")
    await engine.pause(workflow=TICKET, reason="deploy")
    report = await engine.migrate(TICKET, 2, state_map=MAP)
    assert report.applied == 2
    first = await engine.get(ids[0])
    assert (first.state, first.paused, first.definition_version) == ("active", True, 2)
    await engine.resume(workflow=TICKET)
    await _clean(engine, ids)


async def test_a_failing_data_function_fails_its_instance_only(engine: flowlock.Engine) -> None:
    """A data function that raises is a StepFailed in `failed`; the others are migrated."""
    ids = await _make(engine, 3)

    def data(inst: Instance) -> dict[str, Any]:
        if inst.id == ids[1]:
            raise KeyError("missing")
        return dict(inst.data)

    report = await engine.migrate(TICKET, 2, state_map=MAP, data=data)
    assert report.applied == 2 and list(report.failed) == [ids[1]]
    assert report.failed[ids[1]].startswith("StepFailed")
    assert await engine.history(ids[1]) == []


def test_the_sync_engine_migrates() -> None:
    """flowlock.sync.Engine.migrate blocks and answers the same report."""
    with flowlock.sync.Engine(MemoryStore()) as eng:
        eng.register(ticket_v1())
        eng.register(ticket_v2())
        eng.create(TICKET, instance_id="s", version=1)
        report = eng.migrate(TICKET, 2, state_map=MAP)
        assert report.applied == 1 and eng.get("s").state == "active"


# -- the checker -------------------------------------------------------------------------------


def _row(version: int, event: str, src: str, dst: str, dv: int | None, **kw: Any) -> HistoryEntry:
    return HistoryEntry(
        "i", version, event, src, dst, "ops", None, "optimistic", {}, definition_version=dv, **kw
    )


def _kinds(rows: list[HistoryEntry], dv: int | None) -> list[str]:
    last = rows[-1]
    inst = Instance("i", TICKET, last.to_state, last.version, {}, last.event, definition_version=dv)
    return [v.kind for v in check(inst, rows).violations]


def test_the_checker_accepts_a_migration_and_a_first_stamp() -> None:
    """Versions change only on a migrated row; a row of no version may be followed by one."""
    moved = {"payload": migration_payload(2, MAP)}
    rows = [
        _row(2, "hold", "open", "held", None),
        _row(3, "bump", "held", "held", 1),
        _row(4, flowlock.MIGRATE_EVENT, "held", "held", 2, **moved),
        _row(5, "reopen", "held", "active", 2),
    ]
    assert _kinds(rows, 2) == []


def test_the_checker_flags_a_row_under_another_version() -> None:
    """A version change without a migrated row, a wrong stamp, or a wrong instance: flagged."""
    drift = [_row(2, "hold", "open", "held", 1), _row(3, "bump", "held", "held", 2)]
    assert _kinds(drift, 2) == [DEFINITION_VERSION]
    assert _kinds([_row(2, "hold", "open", "held", 1)], 2) == [DEFINITION_VERSION]
    # A row of no version is unknown: skipped, the instance held to the last versioned row.
    unknown = [_row(2, "hold", "open", "held", 1), _row(3, "bump", "held", "held", None)]
    assert _kinds(unknown, 1) == []
    assert _kinds(unknown, 2) == [DEFINITION_VERSION]
    stamped = {"payload": migration_payload(3, {})}
    wrong = [_row(2, flowlock.MIGRATE_EVENT, "open", "open", 2, **stamped)]
    assert _kinds(wrong, 2) == [DEFINITION_VERSION]
    moved = {"payload": migration_payload(2, MAP)}
    astray = [_row(2, flowlock.MIGRATE_EVENT, "open", "held", 2, **moved)]
    assert _kinds(astray, 2) == [REPAIR_ROW]


def test_the_checker_holds_each_row_to_its_versions_rules() -> None:
    """Given the stored definitions, a row applied under another version's rules is flagged."""
    forms = {1: canonical(ticket_v1()), 2: canonical(ticket_v2())}

    def kinds(rows: list[HistoryEntry], dv: int) -> list[str]:
        last = rows[-1]
        inst = Instance(
            "i", TICKET, last.to_state, last.version, {}, last.event, definition_version=dv
        )
        return [v.kind for v in check(inst, rows, definitions=forms).violations]

    moved = {"payload": migration_payload(2, MAP)}
    ruled = [
        _row(2, "hold", "open", "held", 1),
        _row(3, flowlock.MIGRATE_EVENT, "held", "held", 2, **moved),
        _row(4, "reopen", "held", "active", 2),
    ]
    assert kinds(ruled, 2) == []
    # Stamped version 1 throughout, but decided by version 2's rules: only the rules tell.
    newest = [_row(2, "hold", "open", "held", 1), _row(3, "reopen", "held", "active", 1)]
    assert _kinds(newest, 1) == []
    assert kinds(newest, 1) == [DEFINITION_VERSION]
    assert kinds([_row(2, "hold", "held", "held", 1)], 1) == [DEFINITION_VERSION]
    astray = [_row(2, flowlock.MIGRATE_EVENT, "open", "open", 2, **moved)]
    assert DEFINITION_VERSION in kinds(astray, 2)


def test_flowlock_check_flags_a_row_under_another_versions_rules(tmp_path: Path) -> None:
    """`flowlock check` reads the stored definitions: rules of another version fail it."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    with flowlock.sync.Engine.connect(url) as eng:
        eng.register(ticket_v1())
        eng.register(ticket_v2())
        eng.create(TICKET, instance_id="c", version=2)
        eng.fire("c", "hold")
        eng.fire("c", "reopen")
    runner = CliRunner()
    clean = runner.invoke(cli, ["check", "--database-url", url])
    assert clean.exit_code == 0, clean.output
    # As if fire had applied version 2's rules to an instance of version 1.
    with sqlite3.connect(tmp_path / "db.sqlite") as db:
        db.execute("UPDATE flowlock_history SET definition_version = 1")
        db.execute("UPDATE flowlock_instances SET definition_version = 1")
    found = runner.invoke(cli, ["check", "--database-url", url])
    assert found.exit_code == 3, found.output
    said = " ".join(found.output.split())
    assert "'reopen', a transition definition version 1 lacks" in said, said


# -- the command line --------------------------------------------------------------------------


def test_flowlock_admin_migrate(tmp_path: Path) -> None:
    """The CLI refuses a stranded run (exit 1), shows the dry run, then migrates with --yes."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    with flowlock.sync.Engine.connect(url) as eng:
        eng.register(ticket_v1())
        for i in range(3):
            eng.create(TICKET, instance_id=f"c-{i}", version=1)
    runner = CliRunner()
    base = ["admin", "migrate", TICKET, "--to", "2", "--database-url", url,
            "--app", "migrate_kit:both"]  # fmt: skip
    refused = runner.invoke(cli, [*base, "--dry-run"])
    assert refused.exit_code == 1, refused.output
    assert "stranded" in refused.output and "'open' (3)" in refused.output
    shown = runner.invoke(cli, [*base, "--map", "open=active", "--dry-run", "--json"])
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.output)
    assert (body["matched"], body["stranded"], body["dry_run"]) == (3, {}, True)
    typo = runner.invoke(cli, [*base, "--map", "open=active", "--map", "opne=done", "--dry-run"])
    assert typo.exit_code == 0, typo.output
    assert "--map names no state a selected instance is in: opne" in typo.output
    assert runner.invoke(cli, [*base, "--map", "open"]).exit_code == 2
    done = runner.invoke(cli, [*base, "--map", "open=active", "--yes"])
    assert done.exit_code == 0, done.output
    assert "3 migrated" in done.output
    again = runner.invoke(cli, [*base, "--map", "open=active", "--yes", "--json"])
    assert again.exit_code == 0, again.output
    body = json.loads(again.output)  # not a dry run: nothing was left to do
    assert (body["dry_run"], body["matched"], body["already"]) == (False, 0, 3)
    with flowlock.sync.Engine.connect(url) as eng:
        eng.register(ticket_v2())
        assert {eng.get(f"c-{i}").state for i in range(3)} == {"active"}
        assert all(eng.history(f"c-{i}")[-1].migrated for i in range(3))


def test_a_refusal_is_an_http_422_with_the_stranded_states() -> None:
    """MigrationRefused maps to a 422 problem naming each stranded state and its count."""
    from flowlock.http import from_error

    found = from_error(flowlock.MigrationRefused(TICKET, 2, {"open": 3}, ("active", "done")))
    assert (found.status, found.slug) == (422, "migration-refused")
    assert found.members["stranded"] == {"open": 3} and found.members["to_version"] == 2


async def test_a_move_arms_the_target_versions_timers(engine: flowlock.Engine) -> None:
    """A migrated instance that changes state begins a stay armed with version 3's timers."""
    from datetime import timedelta

    timed = Workflow(
        TICKET,
        strategy="adaptive",
        states=["waiting", "held", "done"],
        initial="waiting",
        transitions=[
            Transition("expire", source="waiting", target="done", after=timedelta(hours=1)),
            Transition("hold", source="waiting", target="held"),
            Transition("close", source=["waiting", "held"], target="done"),
        ],
    )
    assert await engine.register(timed) == 3
    (iid, kept) = await _make(engine, 2)
    await engine.fire(kept, "hold")
    report = await engine.migrate(TICKET, 3, state_map={"open": "waiting", "closed": "done"})
    assert report.applied == 2
    (timer,) = await engine.timers(iid)
    row = (await engine.history(iid))[-1]
    assert (timer.event, timer.stay) == ("expire", row.version)
    assert await engine.timers(kept) == []
    await _clean(engine, [iid, kept])
