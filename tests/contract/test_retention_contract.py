"""Retention on every store (memory, SQLite, PostgreSQL: the ``engine`` fixture is parametrised):
holds, purge (dry run, final states, holds, the compare-and-swap that keeps a moved instance),
the archive and its manifest, and restore, after which the checker passes and every restored
instance and history row equals the one archived.

Ages are set, not waited for: the test moves the `updated_at` of the instances meant to be old
an hour back in the store's own rows (tests/age_kit.py), and the purge measures the age on the
store's clock against a bound of ten minutes, so what is made after stays young.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pytest

import flowlock
from age_kit import backdate
from flowlock._inspect import check_instances
from flowlock.admin.archive import ArchiveWriter, manifest_path, read_archive
from flowlock.core.retention import ArchiveInvalid, PurgeSelection
from flowlock.stores.base import RetentionStore
from flowlock.stores.memory import MemoryStore

BOUND = timedelta(minutes=10)


def _ids(prefix: str, n: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"{prefix}-{tag}-{i:03d}" for i in range(n)]


async def _exists(engine: flowlock.Engine, instance_id: str) -> bool:
    try:
        await engine.get(instance_id)
    except flowlock.InstanceNotFound:
        return False
    return True


async def _approvals(engine: flowlock.Engine, ids: list[str], events: list[str | None]) -> None:
    for i, (iid, event) in enumerate(zip(ids, events, strict=True)):
        await engine.create("approval", instance_id=iid, data={"n": i}, request_id=f"mk-{iid}")
        if event is not None:
            await engine.fire(iid, event, actor="alice", request_id=f"{event}-{iid}",
                              payload={"why": i})  # fmt: skip


async def test_holds_are_idempotent_paged_and_may_name_no_instance(
    engine: flowlock.Engine,
) -> None:
    ids = sorted(_ids("h", 5))
    first = await engine.hold(ids[0], reason="litigation 42", actor="legal")
    again = await engine.hold(ids[0], reason="another reason", actor="bob")
    assert again == first and first.reason == "litigation 42" and first.at is not None
    assert first.instance_found is False  # no instance has the id: the caller is told
    for iid in ids[1:]:
        await engine.hold(iid)  # none of these ids exists: a hold is about an id
    page = await engine.holds(limit=3)
    assert [h.instance_id for h in page] == ids[:3]
    rest = await engine.holds(after=page[-1].instance_id, limit=10)
    assert [h.instance_id for h in rest] == ids[3:]
    assert await engine.unhold(ids[1], actor="legal") is True
    assert await engine.unhold(ids[1]) is False
    assert [h.instance_id for h in await engine.holds()] == [ids[0], *ids[2:]]
    assert all(h.instance_found is None for h in await engine.holds())  # read back: unknown
    await engine.create("approval", instance_id=ids[1], request_id=f"mk-{ids[1]}")
    assert (await engine.hold(ids[1])).instance_found is True


async def test_dry_run_counts_and_deletes_nothing(engine: flowlock.Engine) -> None:
    ids = _ids("d", 5)
    await _approvals(engine, ids, ["approve", "reject", None, "approve", None])
    await engine.hold(ids[3])
    await backdate(engine.store, ids)
    report = await engine.purge("approval", older_than=BOUND, dry_run=True)
    assert (report.dry_run, report.matched, report.held, report.purged) == (True, 2, 1, 0)
    for iid in ids:
        assert await _exists(engine, iid)


async def test_purge_takes_old_final_unheld_instances_with_everything_of_theirs(
    engine: flowlock.Engine,
) -> None:
    ids = _ids("p", 6)
    await _approvals(engine, ids, ["approve", "reject", None, "approve", None, None])
    await engine.hold(ids[3], reason="keep")
    await backdate(engine.store, ids)
    young = _ids("y", 1)
    await _approvals(engine, young, ["approve"])  # final, but newer than the bound
    seen: list[int] = []
    report = await engine.purge("approval", older_than=BOUND, batch=1, progress=seen.append)
    assert (report.matched, report.held, report.purged, report.kept) == (2, 1, 2, 0)
    assert report.batches == 2 and sum(seen) == 2 and report.longest_batch > 0
    for iid in ids[:2]:
        assert not await _exists(engine, iid)
        with pytest.raises(flowlock.InstanceNotFound):
            await engine.history(iid)
        assert await engine.store.create_request(iid) is None
    for iid in [*ids[2:], *young]:
        assert await _exists(engine, iid)
    assert [h.instance_id for h in await engine.holds()] == [ids[3]]
    # A create under the purged instance's key makes a new instance: the key went with it.
    again = await engine.create("approval", instance_id=ids[0], request_id=f"mk-{ids[0]}")
    assert again.version == 1


async def test_an_instance_that_moved_after_the_read_is_kept(engine: flowlock.Engine) -> None:
    """The delete is a compare-and-swap on the version read."""
    ids = _ids("m", 3)
    await _approvals(engine, ids, [None, None, None])
    await backdate(engine.store, ids)
    store = engine.store
    assert isinstance(store, RetentionStore)
    selection = PurgeSelection("approval", ("pending",), BOUND.total_seconds())
    found = await store.purge_candidates(selection, after=None, limit=10)
    assert [a.instance.id for a in found] == sorted(ids)
    await engine.fire(ids[1], "approve")  # moves on after the read
    await engine.hold(ids[2])  # held after the read
    gone = await store.purge_batch([(a.instance.id, a.instance.version) for a in found])
    assert gone == [ids[0]]
    assert await _exists(engine, ids[1]) and await _exists(engine, ids[2])


async def test_archive_then_restore_gives_back_every_row_and_the_checker_passes(
    engine: flowlock.Engine, tmp_path: Path
) -> None:
    ids = _ids("a", 7)
    await _approvals(engine, ids, ["approve", "reject", "approve", None, "approve", "reject", None])
    # An operator's pause is part of the instance: archived and restored with it.
    await engine.pause(ids[2], reason="looking into it", actor="ops")
    await backdate(engine.store, ids)
    before = {iid: (await engine.get(iid), await engine.history(iid)) for iid in ids}
    assert before[ids[2]][0].paused
    made = {iid: await engine.store.create_request(iid) for iid in ids}
    path = tmp_path / "approval.jsonl.gz"
    report = await engine.purge("approval", older_than=BOUND, archive=path, batch=2)
    assert report.purged == 5 and report.archive == path
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["lines"] == 5 and manifest["workflow"] == "approval"
    assert manifest["bound"]["final"] is True and len(manifest["sha256"]) == 64
    with gzip.open(path, "rb") as f:
        lines = [json.loads(line) for line in f]
    assert sorted(line["instance"]["id"] for line in lines) == sorted(
        iid for iid in ids if before[iid][0].state != "pending"
    )

    restored = await engine.restore(path, batch=3)
    assert (restored.lines, restored.restored, restored.skipped) == (5, 5, ())
    for iid in ids:
        inst, history = before[iid]
        assert (await engine.get(iid)).evolve(next_timer=None) == inst
        assert await engine.history(iid) == history
        assert await engine.store.create_request(iid) == made[iid]
    verdict = (await check_instances(engine, None)).verdict
    assert verdict.ok, verdict.violations
    # A restored instance goes on as before: its request ids are still spent.
    replay = await engine.fire(ids[0], "approve", actor="alice", request_id=f"approve-{ids[0]}",
                               payload={"why": 0})  # fmt: skip
    assert replay.replayed

    again = await engine.restore(path)
    assert again.restored == 0 and sorted(again.skipped) == sorted(
        iid for iid in ids if before[iid][0].state != "pending"
    )


async def test_a_damaged_archive_is_refused_naming_the_file(
    engine: flowlock.Engine, tmp_path: Path
) -> None:
    ids = _ids("x", 2)
    await _approvals(engine, ids, ["approve", "reject"])
    await backdate(engine.store, ids)
    path = tmp_path / "x.jsonl.gz"
    await engine.purge("approval", older_than=BOUND, archive=path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ArchiveInvalid, match=r"x\.jsonl\.gz") as caught:
        await engine.restore(path)
    assert caught.value.path == path and "sha256" in caught.value.problem
    assert isinstance(caught.value, flowlock.FlowlockError)
    for iid in ids:
        assert not await _exists(engine, iid)  # nothing restored


async def test_an_archive_without_its_manifest_needs_verify_false(
    engine: flowlock.Engine, tmp_path: Path
) -> None:
    ids = _ids("n", 2)
    await _approvals(engine, ids, ["approve", "reject"])
    await backdate(engine.store, ids)
    path = tmp_path / "n.jsonl.gz"
    await engine.purge("approval", older_than=BOUND, archive=path)
    manifest_path(path).unlink()
    with pytest.raises(ArchiveInvalid, match="manifest"):
        await engine.restore(path)
    # A purge that crashed leaves a torn last member: reading stops there.
    path.write_bytes(path.read_bytes() + gzip.compress(b'{"instance": ')[:-6])
    report = await engine.restore(path, verify=False)
    assert report.restored == 2


async def test_bad_arguments_purge_nothing(engine: flowlock.Engine, tmp_path: Path) -> None:
    ids = _ids("b", 1)
    await _approvals(engine, ids, ["approve"])
    await backdate(engine.store, ids)
    with pytest.raises(flowlock.UnknownWorkflow):
        await engine.purge("no-such-flow", older_than=BOUND)
    with pytest.raises(flowlock.InvalidInput, match="not final"):
        await engine.purge("approval", older_than=BOUND, states=["pending"])
    for bad in (timedelta(0), 90, None):
        with pytest.raises(flowlock.InvalidInput, match="older_than"):
            await engine.purge("approval", older_than=bad)  # type: ignore[arg-type]
    with pytest.raises(flowlock.InvalidInput, match="batch"):
        await engine.purge("approval", older_than=BOUND, batch=0)
    taken = tmp_path / "taken.gz"
    taken.write_bytes(b"")
    with pytest.raises(flowlock.InvalidInput, match="never overwritten"):
        await engine.purge("approval", older_than=BOUND, archive=taken)
    assert await _exists(engine, ids[0])
    with pytest.raises(flowlock.InvalidInput):
        await engine.hold("")


@pytest.mark.parametrize("write_fails", [False, True], ids=["write-ends", "write-fails"])
async def test_a_purge_cancelled_mid_write_leaves_an_archive_of_exactly_what_went(
    engine: flowlock.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_fails: bool
) -> None:
    """Ctrl-C (a cancel) while the second batch's archive write runs in its thread: the purge
    waits for that batch to end, keeps its lines if it committed, cuts them back if it rolled
    back, and only then writes the manifest. The archive verifies and restores."""
    if isinstance(engine.store, MemoryStore):
        pytest.skip(
            "the memory store writes the archive on the event loop: no cancel lands mid-write"
        )
    ids = _ids("c", 6)
    await _approvals(engine, ids, ["approve"] * 6)
    await backdate(engine.store, ids)
    entered, gate = threading.Event(), threading.Event()
    real = ArchiveWriter.write
    writes = 0

    def gated(self: ArchiveWriter, lines: Sequence[bytes]) -> None:
        nonlocal writes
        writes += 1
        if writes == 2:
            entered.set()
            gate.wait(10)
            if write_fails:  # a torn member, then the disk's error
                self._file.write(b"\x1f\x8b torn")
                raise OSError(28, "No space left on device")
        real(self, lines)

    monkeypatch.setattr(ArchiveWriter, "write", gated)
    path = tmp_path / "c.jsonl.gz"
    purge = asyncio.create_task(engine.purge("approval", older_than=BOUND, archive=path, batch=2))
    assert await asyncio.to_thread(entered.wait, 10)
    purge.cancel()
    await asyncio.sleep(0.3)
    assert not purge.done(), "a cancelled purge waits for its batch in flight"
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await purge
    gone = [iid for iid in ids if not await _exists(engine, iid)]
    assert len(gone) == (2 if write_fails else 4)
    archived = [item.instance.id for item in read_archive(path)]  # the manifest matches
    assert sorted(archived) == sorted(gone)
    restored = await engine.restore(path)
    assert restored.restored == len(gone) and restored.skipped == ()
    assert all([await _exists(engine, iid) for iid in ids])
    verdict = (await check_instances(engine, None)).verdict
    assert verdict.ok, verdict.violations
