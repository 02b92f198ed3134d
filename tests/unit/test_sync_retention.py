"""The sync API's retention: `flowlock.sync.Engine` holds, purges (archiving) and restores as the
async engine does, from a plain thread, on the memory and SQLite stores. An instance with an
outbox message still to deliver is never purged (the delivery would be lost)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

import flowlock
import flowlock.sync
from age_kit import backdate_memory, backdate_sqlite
from flowlock import examples
from flowlock.stores.memory import MemoryStore

BOUND = timedelta(minutes=10)


def _shipping() -> flowlock.Workflow:
    """`ship` emits one message, which stays pending: these engines run no dispatcher."""
    return flowlock.Workflow(
        "shipping",
        states=["new", "shipped", "lost"],
        initial="new",
        transitions=[
            flowlock.Transition(
                "ship",
                source="new",
                target="shipped",
                emit=lambda inst, payload, actor: [flowlock.Emit("carrier", {"id": inst.id})],
            ),
            flowlock.Transition("lose", source="new", target="lost"),
        ],
    )


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_hold_purge_and_restore_from_a_plain_thread(kind: str, tmp_path: Path) -> None:
    url = "memory://" if kind == "memory" else f"sqlite:///{tmp_path / 'f.db'}"
    with flowlock.sync.Engine.connect(url, outbox=False) as engine:
        engine.register(examples.approval())
        engine.register(_shipping())
        for i in range(4):
            engine.create("approval", instance_id=f"a{i}")
            engine.fire(f"a{i}", "approve", actor="alice")
        engine.create("shipping", instance_id="s-pending")
        engine.fire("s-pending", "ship")  # its message is pending: kept
        engine.create("shipping", instance_id="s-done")
        engine.fire("s-done", "lose")
        held = engine.hold("a2", reason="audit", actor="legal")
        assert engine.holds() == [held] and held.instance_found is True
        # Aged an hour by moving updated_at back (tests/age_kit.py), not by sleeping.
        aged = [f"a{i}" for i in range(4)] + ["s-pending", "s-done"]
        if kind == "sqlite":
            backdate_sqlite(str(tmp_path / "f.db"), aged)
        else:
            store = engine._engine.store  # test-data setup; the loop's thread is idle now
            assert isinstance(store, MemoryStore)
            backdate_memory(store, aged)

        dry = engine.purge("approval", older_than=BOUND, dry_run=True)
        assert (dry.matched, dry.held, dry.purged) == (3, 1, 0)
        path = tmp_path / "approval.jsonl.gz"
        done = engine.purge("approval", older_than=BOUND, archive=path)
        assert (done.purged, done.kept) == (3, 0)
        assert [i.id for i in engine.list("approval")] == ["a2"]

        shipped = engine.purge("shipping", older_than=BOUND)
        assert shipped.purged == 1 and [i.id for i in engine.list("shipping")] == ["s-pending"]
        assert len(engine.messages("s-pending")) == 1

        assert engine.unhold("a2") is True
        report = engine.restore(path)
        assert (report.restored, report.skipped) == (3, ())
        assert sorted(i.id for i in engine.list("approval")) == ["a0", "a1", "a2", "a3"]
        assert [h.event for h in engine.history("a0")] == ["approve"]
