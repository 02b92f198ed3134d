"""Bulk operations without a server: the operation and request ids, every argument check, the
walk (replays skipped, an instance that moved read again, max_failures, progress), the sync twin,
POST /admin/bulk through the ASGI app and `flowlock admin` through typer's runner (SQLite)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

import flowlock
from bulk_kit import METER, meter
from flowlock._calls import MAX_ID_LENGTH, caller_request_id
from flowlock.cli import app as cli
from flowlock.core import bulk as core_bulk
from flowlock.core.bulk import bulk_request_id, check_operation_id, derive_operation_id

ACTOR = "ops"


@pytest.fixture
async def engine() -> AsyncIterator[flowlock.Engine]:
    async with flowlock.connect("memory://") as eng:
        await eng.register(meter())
        yield eng


async def _make(engine: flowlock.Engine, n: int, prefix: str = "m") -> list[str]:
    ids = [f"{prefix}-{i:03d}" for i in range(n)]
    for iid in ids:
        await engine.create(METER, instance_id=iid, data={"n": 0})
    return ids


# -- ids ---------------------------------------------------------------------------------------


def test_the_derived_operation_id_depends_on_every_argument_and_nothing_else() -> None:
    args = {"workflow": "meter", "states": ("open",), "event": "hold", "actor": "ops"}
    one = derive_operation_id("fire", args)
    assert one == derive_operation_id("fire", dict(reversed(args.items())))
    assert len(one) == 16
    assert check_operation_id(one) == one
    assert one != derive_operation_id("force", args)
    assert one != derive_operation_id("fire", {**args, "actor": "someone"})
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    assert derive_operation_id("fire", {"updated_before": moment}) == derive_operation_id(
        "fire", {"updated_before": moment}
    )


def test_a_request_id_fits_the_engines_limit_however_long_the_instance_id() -> None:
    assert core_bulk._MAX_REQUEST_ID == MAX_ID_LENGTH
    assert bulk_request_id("op1", "order-7") == "bulk:op1:order-7"
    longest = "x" * MAX_ID_LENGTH
    op = "o" * core_bulk.MAX_OPERATION_ID
    rid = bulk_request_id(op, longest)
    assert len(rid) <= MAX_ID_LENGTH
    assert rid.startswith(f"bulk:{op}:sha256:")
    assert rid == bulk_request_id(op, longest)
    assert rid != bulk_request_id(op, "y" * MAX_ID_LENGTH)
    # The engine takes it as a caller's request id.
    assert caller_request_id(rid, longest) == rid


@pytest.mark.parametrize("bad", ["", "a:b", "-x", "a" * 65, "é", 7, None])
def test_a_bad_operation_id_is_refused(bad: object) -> None:
    with pytest.raises(flowlock.InvalidInput, match="operation_id"):
        check_operation_id(bad)


# -- argument checks -------------------------------------------------------------------------

NAIVE = datetime(2026, 1, 1)


@pytest.mark.parametrize(
    ("action", "kwargs", "match"),
    [
        ("delete", {}, "bulk action must be one of"),
        ("force", {"state": "held", "actor": ACTOR}, "needs a reason"),
        ("force", {"state": "held", "reason": "r"}, "needs an actor"),
        ("force", {"reason": "r", "actor": ACTOR}, "needs state="),
        ("force", {"state": "nowhere", "reason": "r", "actor": ACTOR}, "has no state 'nowhere'"),
        ("pause", {}, "needs a reason"),
        ("pause", {"reason": "r", "event": "hold"}, "does not take event"),
        ("resume", {"state": "held"}, "does not take state"),
        ("fire", {}, "needs event="),
        ("fire", {"event": "no way"}, "not a valid event name"),
        ("fire", {"event": "hold", "reason": "r"}, "does not take reason"),
        ("fire", {"event": "hold", "data": {}}, "does not take data"),
        ("fire", {"event": "hold", "payload": {"x": float("nan")}}, "payload"),
        ("fire", {"event": "hold", "actor": ""}, "actor"),
        ("fire", {"event": "hold", "batch": 0}, "batch"),
        ("fire", {"event": "hold", "batch": 1001}, "batch"),
        ("fire", {"event": "hold", "concurrency": 0}, "concurrency"),
        ("fire", {"event": "hold", "sample": -1}, "sample"),
        ("fire", {"event": "hold", "max_failures": 0}, "max_failures"),
        ("fire", {"event": "hold", "operation_id": "a:b"}, "operation_id"),
        ("fire", {"event": "hold", "dry_run": "yes"}, "dry_run"),
        ("fire", {"event": "hold", "progress": 3}, "progress"),
        ("fire", {"event": "hold", "updated_before": NAIVE}, "naive"),
        ("fire", {"event": "hold", "states": ["open", "no way"]}, "not a valid name"),
    ],
)
async def test_bad_arguments_are_refused_before_anything_is_written(
    engine: flowlock.Engine, action: str, kwargs: dict[str, Any], match: str
) -> None:
    ids = await _make(engine, 3)
    with pytest.raises(flowlock.InvalidInput, match=match):
        await engine.bulk(action, workflow=METER, **kwargs)  # type: ignore[arg-type]
    assert [(await engine.get(i)).version for i in ids] == [1, 1, 1]


async def test_force_and_fire_need_the_workflow_registered(engine: flowlock.Engine) -> None:
    with pytest.raises(flowlock.UnknownWorkflow):
        await engine.bulk("fire", workflow="elsewhere", event="hold")


# -- the walk --------------------------------------------------------------------------------


async def test_a_dry_run_counts_and_samples_and_writes_nothing(engine: flowlock.Engine) -> None:
    ids = await _make(engine, 12)
    await engine.fire(ids[0], "hold")
    report = await engine.bulk(
        "fire", workflow=METER, states="open", event="hold", dry_run=True, sample=4
    )
    assert (report.dry_run, report.matched, report.done) == (True, 11, 0)
    assert [i.id for i in report.sample] == ids[1:5]
    assert [(await engine.get(i)).version for i in ids[1:]] == [1] * 11
    none = await engine.bulk("fire", workflow=METER, event="hold", dry_run=True, sample=0)
    assert (none.matched, none.sample) == (12, ())
    # The real run's operation id is the dry run's: the same arguments.
    real = await engine.bulk("fire", workflow=METER, states="open", event="hold", sample=4)
    assert real.operation_id == report.operation_id
    assert (real.applied, real.skipped, real.ok) == (11, 0, True)


async def test_a_run_again_replays_every_instance(engine: flowlock.Engine) -> None:
    ids = await _make(engine, 30)
    seen: list[int] = []
    first = await engine.bulk(
        "fire", workflow=METER, event="hold", payload={"ticket": 7}, batch=7, concurrency=3,
        progress=seen.append,
    )  # fmt: skip
    assert (first.matched, first.applied, first.skipped, first.failed) == (30, 30, 0, {})
    assert seen == list(range(1, 31))
    again = await engine.bulk(
        "fire", workflow=METER, event="hold", payload={"ticket": 7}, batch=7, concurrency=3
    )
    assert again.operation_id == first.operation_id
    assert (again.applied, again.skipped, again.replayed, again.failed) == (0, 0, 30, {})
    assert again.only_replayed and not first.only_replayed
    for iid in ids:
        (entry,) = await engine.history(iid)
        assert entry.request_id == f"bulk:{first.operation_id}:{iid}"
        assert (entry.actor, entry.payload) == (None, {"ticket": 7})


async def test_an_instance_that_moved_is_read_again(
    engine: flowlock.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the page's read and the call: one instance is bumped (still selected: done at
    its new version), one leaves the selection (skipped: not done)."""
    ids = await _make(engine, 6)
    listed = engine.list

    async def list_then_move(*args: Any, **kwargs: Any) -> flowlock.Page:
        page = await listed(*args, **kwargs)
        if len(page) == 6:  # the walk's page, not the sample's
            await engine.fire(ids[1], "bump")
            await engine.fire(ids[2], "close")
        return page

    monkeypatch.setattr(engine, "list", list_then_move)
    report = await engine.bulk("fire", workflow=METER, states="open", event="hold", sample=0)
    assert (report.applied, report.skipped, report.failed) == (5, 1, {})
    states = {i: (await engine.get(i)).state for i in ids}
    assert states == {**dict.fromkeys(ids, "held"), ids[2]: "closed"}
    assert (await engine.get(ids[1])).data == {"n": 1}


async def test_failures_are_reported_and_stop_the_run_at_max_failures(
    engine: flowlock.Engine,
) -> None:
    ids = await _make(engine, 10)
    for iid in ids[:5]:
        await engine.fire(iid, "close")
    report = await engine.bulk(
        "fire", workflow=METER, event="hold", concurrency=1, max_failures=3, batch=2
    )
    assert sorted(report.failed) == ids[:3]
    assert all(why.startswith("TransitionNotAllowed: ") for why in report.failed.values())
    assert report.stopped is not None and "max_failures" in report.stopped
    assert (report.applied, report.ok) == (0, False)
    # Without a bound, the run goes on past every failure.
    whole = await engine.bulk("fire", workflow=METER, event="hold", max_failures=None)
    assert (len(whole.failed), whole.applied, whole.stopped) == (5, 5, None)


def test_the_sync_engine_runs_bulk_too() -> None:
    with flowlock.sync.Engine.connect("memory://") as eng:
        eng.register(meter())
        for i in range(5):
            eng.create(METER, instance_id=f"s{i}")
        done: list[int] = []
        report = eng.bulk("fire", workflow=METER, event="hold", progress=done.append)
        assert (report.applied, done[-1]) == (5, 5)
        assert {eng.get(f"s{i}").state for i in range(5)} == {"held"}


# -- HTTP ----------------------------------------------------------------------------------------


async def test_post_admin_bulk_through_the_asgi_app() -> None:
    from flowlock.service.app import create_app

    app = create_app(workflows=[meter()])
    async with app.router.lifespan_context(app):
        engine: flowlock.Engine = app.state.engine
        ids = await _make(engine, 8)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            body = {"action": "fire", "workflow": METER, "event": "hold", "actor": ACTOR}
            dry = await client.post(
                "/admin/bulk", json={**body, "dry_run": True, "sample": 2,
                                     "updated_before": "2999-01-01T00:00:00Z"},
            )  # fmt: skip
            assert dry.status_code == 200, dry.text
            assert dry.json()["matched"] == 8
            assert [i["id"] for i in dry.json()["sample"]] == ids[:2]
            assert dry.json()["sample"][0]["allowed"] == ["bump", "hold", "close"]
            assert {(await engine.get(i)).version for i in ids} == {1}
            done = await client.post("/admin/bulk", json=body)
            assert done.status_code == 200, done.text
            answer = done.json()
            assert (answer["applied"], answer["skipped"], answer["failed"]) == (8, 0, {})
            assert answer["stopped"] is None and answer["dry_run"] is False
            again = (await client.post("/admin/bulk", json=body)).json()
            assert (again["applied"], again["skipped"], again["replayed"]) == (0, 0, 8)
            assert again["operation_id"] == answer["operation_id"]
            assert answer["note"] is None
            assert again["note"] == (
                f"8 were done earlier by operation {answer['operation_id']} (a rerun) and not "
                "done again; send another operation_id to run the operation again"
            )
            for bad, status in [
                ({**body, "surprise": 1}, 422),
                ({**body, "action": "delete"}, 422),
                ({**body, "updated_before": "2026-01-01T00:00:00"}, 422),
                ({**body, "event": None}, 422),
                ({**body, "batch": 5000}, 422),
            ]:
                refused = await client.post("/admin/bulk", json=bad)
                assert refused.status_code == status, (bad, refused.text)
                assert refused.headers["content-type"] == "application/problem+json"


# -- CLI -----------------------------------------------------------------------------------------


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    # Sync: the CLI runs its own event loop, so its tests run outside one.
    url = f"sqlite:///{tmp_path / 'bulk.db'}"
    with flowlock.sync.Engine.connect(url) as eng:
        eng.register(meter())
        for i in range(25):
            eng.create(METER, instance_id=f"c-{i:02d}", data={"n": 0})
        eng.fire("c-00", "close")
    return url


def _admin(url: str, *args: str, input: str | None = None) -> Any:
    base = ["admin", *args, "--database-url", url, "--app", "bulk_kit:workflows"]
    return CliRunner().invoke(cli, base, input=input)


def _states(url: str) -> Mapping[str, str]:
    with flowlock.sync.Engine.connect(url) as eng:
        return {i.id: i.state for i in eng.list(METER, limit=1000)}


def test_the_cli_shows_asks_runs_and_reports(sqlite_url: str) -> None:
    fire = ("fire", "--event", "hold", "-w", METER, "-s", "open", "--actor", ACTOR)
    dry = _admin(sqlite_url, *fire, "--dry-run", "--sample", "3")
    assert dry.exit_code == 0, dry.output
    assert "24 instance(s) match; the first 3" in dry.output and "c-03" in dry.output
    assert "operation id: " in dry.output
    operation = dry.output.split("operation id: ")[1].split()[0]
    refused = _admin(sqlite_url, *fire, input="n\n")
    assert refused.exit_code == 1, refused.output
    assert "not confirmed; nothing was written" in refused.output
    assert set(_states(sqlite_url).values()) == {"open", "closed"}
    done = _admin(sqlite_url, *fire, "--json", input="y\n")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output[done.output.index("{") :])
    assert (report["operation_id"], report["applied"], report["failed"]) == (operation, 24, {})
    states = _states(sqlite_url)
    assert states == {**dict.fromkeys(states, "held"), "c-00": "closed"}
    nothing = _admin(sqlite_url, *fire, "--yes")
    assert nothing.exit_code == 0 and "nothing matches" in nothing.output


def test_the_cli_exits_1_when_an_instance_failed(sqlite_url: str) -> None:
    failed = _admin(sqlite_url, "fire", "--event", "hold", "-w", METER, "--yes")
    assert failed.exit_code == 1, failed.output
    assert "24 applied, 0 skipped, 0 replayed, 1 failed" in failed.output
    assert "c-00: TransitionNotAllowed" in failed.output


def test_the_cli_exits_3_when_the_same_pause_only_replays(sqlite_url: str) -> None:
    pause = ("pause", "-w", METER, "--reason", "incident", "--yes")
    assert _admin(sqlite_url, *pause).exit_code == 0
    assert _admin(sqlite_url, "resume", "-w", METER, "--yes").exit_code == 0
    again = _admin(sqlite_url, *pause)
    assert again.exit_code == 3, again.output
    assert "0 applied, 0 skipped, 25 replayed, 0 failed" in again.output
    flat = " ".join(again.output.split())
    assert "25 were done earlier by operation " in flat
    assert (
        "(a rerun) and not done again; pass --operation-id NEW to run the operation again" in flat
    )
    with flowlock.sync.Engine.connect(sqlite_url) as eng:
        assert {i.paused for i in eng.list(METER, limit=100)} == {False}
    as_json = _admin(sqlite_url, *pause, "--json")
    assert as_json.exit_code == 3
    report = json.loads(as_json.output[as_json.output.index("{") :])
    assert (report["replayed"], report["applied"]) == (25, 0)
    assert "pass --operation-id NEW" in report["note"]
    new = _admin(sqlite_url, *pause, "--operation-id", "pause-2")
    assert new.exit_code == 0, new.output
    assert "25 applied, 0 skipped, 0 replayed" in new.output
    with flowlock.sync.Engine.connect(sqlite_url) as eng:
        assert {i.paused for i in eng.list(METER, limit=100)} == {True}


def test_the_cli_rerun_that_finishes_a_crashed_run_succeeds(sqlite_url: str) -> None:
    """Five instances were done by operation op1 before it crashed: the rerun replays them,
    does the other twenty, says so, and exits 0."""
    with flowlock.sync.Engine.connect(sqlite_url) as eng:
        eng.register(meter())
        for i in range(5):
            iid = f"c-{i:02d}"
            eng.pause(iid, reason="incident", request_id=bulk_request_id("op1", iid))
    rerun = _admin(
        sqlite_url, "pause", "-w", METER, "--reason", "incident", "--operation-id", "op1",
        "--actor", ACTOR, "--yes",
    )  # fmt: skip
    assert rerun.exit_code == 0, rerun.output
    assert "20 applied, 0 skipped, 5 replayed, 0 failed" in rerun.output
    assert "5 were done earlier by operation op1" in " ".join(rerun.output.split())


def test_the_cli_pauses_and_resumes_without_app(sqlite_url: str) -> None:
    """Pause and resume need no definition: without --app (nothing registered) each instance
    is paused and resumed; force still asks for --app."""

    def bare(*args: str) -> Any:
        return CliRunner().invoke(cli, ["admin", *args, "--database-url", sqlite_url])

    paused = bare("pause", "--workflow", METER, "--reason", "incident", "--yes")
    assert paused.exit_code == 0, paused.output
    assert "25 applied, 0 skipped, 0 replayed, 0 failed" in paused.output
    with flowlock.sync.Engine.connect(sqlite_url) as eng:
        assert {i.paused for i in eng.list(METER, limit=100)} == {True}
    resumed = bare("resume", "--workflow", METER, "--yes")
    assert resumed.exit_code == 0, resumed.output
    assert "25 applied, 0 skipped, 0 replayed, 0 failed" in resumed.output
    with flowlock.sync.Engine.connect(sqlite_url) as eng:
        assert {i.paused for i in eng.list(METER, limit=100)} == {False}
    forced = bare("force", "--workflow", METER, "--to", "held", "--reason", "r", "--yes")
    assert forced.exit_code == 2 and "--app" in forced.output


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("fire", "--event", "hold", "--updated-before", "yesterday"), "neither a time"),
        (("fire", "--event", "hold", "--updated-before", "9999999w"), "too long an age"),
        (("fire", "--event", "hold", "--updated-after", "99999999999d"), "too long an age"),
        (("fire", "--event", "hold", "--updated-after", "2026-01-01T00:00:00"), "neither a time"),
        (("fire", "--event", "hold", "--payload", "[1]"), "JSON object"),
        (("force", "--to", "held", "--reason", "r", "--data", "{"), "not JSON"),
    ],
)
def test_the_cli_refuses_bad_options(sqlite_url: str, args: tuple[str, ...], match: str) -> None:
    result = _admin(sqlite_url, *args, "--yes")
    assert result.exit_code == 2, result.output
    assert match in result.output
    assert set(_states(sqlite_url).values()) == {"open", "closed"}


def test_an_age_selects_by_the_time_of_the_last_change(sqlite_url: str) -> None:
    recent = _admin(sqlite_url, "fire", "--event", "hold",
                    "--updated-before", "1h", "--dry-run", "--json")  # fmt: skip
    assert recent.exit_code == 0, recent.output
    assert json.loads(recent.output)["matched"] == 0
    hour_ago = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    since = _admin(sqlite_url, "fire", "--event", "hold", "--updated-after", hour_ago,
                   "--dry-run", "--json")  # fmt: skip
    assert json.loads(since.output)["matched"] == 25


# -- force, pause, resume ----------------------------------------------------------------------


async def test_bulk_force_writes_one_forced_row_per_instance(engine: flowlock.Engine) -> None:
    ids = await _make(engine, 9)
    await engine.fire(ids[0], "bump")
    args: dict[str, Any] = {"state": "held", "reason": "stuck after the outage", "actor": ACTOR}
    report = await engine.bulk("force", workflow=METER, states="open", batch=4, **args)
    assert (report.matched, report.applied, report.skipped, report.failed) == (9, 9, 0, {})
    for iid in ids:
        inst, history = await engine.get(iid), await engine.history(iid)
        assert inst.state == "held"
        forced = [e for e in history if e.forced]
        assert len(forced) == 1
        assert forced[0].request_id == f"bulk:{report.operation_id}:{iid}"
        assert (forced[0].actor, forced[0].reason) == (ACTOR, "stuck after the outage")
    assert (await engine.get(ids[0])).data == {"n": 1}  # data=None keeps each instance's own
    # Under the same operation id, over the whole workflow (other filters: another derived
    # id, so it is given): every instance is replayed, none forced twice.
    again = await engine.bulk("force", workflow=METER, operation_id=report.operation_id, **args)
    assert (again.applied, again.skipped, again.replayed) == (0, 0, 9)
    # With data, each instance's data is replaced.
    data = await engine.bulk("force", workflow=METER, data={"n": 100}, **args)
    assert (data.applied, {(await engine.get(i)).data["n"] for i in ids}) == (9, {100})


async def test_the_same_bulk_pause_after_a_resume_is_reported_as_replayed_not_skipped(
    engine: flowlock.Engine,
) -> None:
    """pause, resume, the same pause again: the derived id replays the first pause, so the
    instances stay unpaused. The report says so (replayed, a note), never "skipped"; a new
    operation id pauses them."""
    ids = await _make(engine, 3)
    first = await engine.bulk("pause", workflow=METER, reason="incident")
    await engine.bulk("resume", workflow=METER)
    again = await engine.bulk("pause", workflow=METER, reason="incident")
    assert again.operation_id == first.operation_id
    assert (again.applied, again.skipped, again.replayed, again.failed) == (0, 0, 3, {})
    assert again.only_replayed and again.ok and again.done == 3
    assert again.replay_note("pass --operation-id NEW") == (
        f"3 were done earlier by operation {first.operation_id} (a rerun) and not done again; "
        "pass --operation-id NEW to run the operation again"
    )
    assert again.summary()["replayed"] == 3
    assert first.replay_note("x") is None
    assert [(await engine.get(i)).paused for i in ids] == [False] * 3
    new = await engine.bulk("pause", workflow=METER, reason="incident", operation_id="second")
    assert (new.applied, new.replayed, new.only_replayed) == (3, 0, False)
    assert [(await engine.get(i)).paused for i in ids] == [True] * 3


async def test_bulk_pause_and_resume(engine: flowlock.Engine) -> None:
    ids = await _make(engine, 6)
    await engine.pause(ids[0], reason="already", actor=ACTOR)
    paused = await engine.bulk("pause", workflow=METER, reason="maintenance", actor=ACTOR)
    assert (paused.applied, paused.skipped, paused.failed) == (5, 1, {})
    assert [(await engine.get(i)).paused for i in ids] == [True] * 6
    with pytest.raises(flowlock.InstancePaused):
        await engine.fire(ids[1], "bump")
    # A bulk fire at paused instances fails each, typed, and the run goes on.
    refused = await engine.bulk("fire", workflow=METER, event="bump")
    assert sorted(refused.failed) == ids
    assert all(why.startswith("InstancePaused: ") for why in refused.failed.values())
    # Force still works on a paused instance.
    forced = await engine.bulk(
        "force", workflow=METER, state="held", reason="repair", actor=ACTOR, sample=0
    )
    assert forced.applied == 6
    resumed = await engine.bulk("resume", workflow=METER, states=["held"])
    assert (resumed.applied, resumed.skipped) == (6, 0)
    assert [(await engine.get(i)).paused for i in ids] == [False] * 6
    twice = await engine.bulk("resume", workflow=METER, reason="once more")
    assert (twice.applied, twice.skipped) == (0, 6)
    kinds = [e.kind for e in await engine.history(ids[3])]
    assert kinds == ["pause", "forced", "resume"]


async def test_a_failed_read_of_a_page_raises_its_own_typed_error(
    engine: flowlock.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database gone while the run walks: the run raises the store's error as it was
    raised (not wrapped in a group), and running it again does the rest."""
    ids = await _make(engine, 9)
    listed = engine.list
    reads = 0

    async def second_page_fails(*args: Any, **kwargs: Any) -> flowlock.Page:
        nonlocal reads
        reads += 1
        if reads == 3:  # the sample's read, the first page, then this
            raise flowlock.StoreError("the database went away")
        return await listed(*args, **kwargs)

    monkeypatch.setattr(engine, "list", second_page_fails)
    with pytest.raises(flowlock.StoreError, match="went away"):
        await engine.bulk("fire", workflow=METER, event="hold", batch=4, concurrency=2)
    monkeypatch.setattr(engine, "list", listed)
    report = await engine.bulk("fire", workflow=METER, event="hold", batch=4, concurrency=2)
    assert report.applied + report.replayed == 9 and report.failed == {}
    assert report.applied > 0 and not report.only_replayed  # a crash rerun that did the rest
    assert {(await engine.get(i)).state for i in ids} == {"held"}


def test_the_cli_says_how_to_finish_a_run_that_did_not(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database goes away while the operator reads the prompt: the run fails with one
    error line, and says to run the same command again."""
    path = Path(sqlite_url.removeprefix("sqlite:///"))

    def answer_yes_as_the_file_goes(text: str, **_: Any) -> bool:
        assert "fire 24 instance(s)" in text
        path.unlink()  # between the look and the run
        return True

    monkeypatch.setattr(typer, "confirm", answer_yes_as_the_file_goes)
    result = _admin(sqlite_url, "fire", "--event", "hold", "-s", "open")
    assert result.exit_code == 1, result.output
    assert "error: " in result.output
    assert "did not finish: run the same command again" in result.output
