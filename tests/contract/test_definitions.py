"""Versioned definitions on every store (memory, SQLite, PostgreSQL): the DefinitionStore port,
register's versions, instances pinned to theirs, and DefinitionMismatch writing nothing."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import pytest

import flowlock
from conftest import StoreFactory
from flowlock.core.versions import canonical, content_hash
from flowlock.stores.base import DefinitionStore


def doc(*, extra: bool = False, drop_review: bool = False) -> flowlock.Workflow:
    """A small workflow; `extra` adds a transition, `drop_review` removes a state."""
    if drop_review:
        return flowlock.Workflow(
            "doc",
            states=["draft", "done"],
            initial="draft",
            transitions=[flowlock.Transition("finish", source="draft", target="done")],
        )
    transitions = [
        flowlock.Transition("submit", source="draft", target="review"),
        flowlock.Transition("approve", source="review", target="done"),
    ]
    if extra:
        transitions.append(flowlock.Transition("reopen", source="done", target="draft"))
    return flowlock.Workflow(
        "doc", states=["draft", "review", "done"], initial="draft", transitions=transitions
    )


async def test_save_definition_is_idempotent_per_hash_and_numbers_new_ones(
    store_factory: StoreFactory,
) -> None:
    """The same hash is the same version (new only the first time); a new hash is max + 1;
    versions are per workflow; definitions() lists them with instance counts."""
    store = store_factory()
    await store.open()
    try:
        assert isinstance(store, DefinitionStore)
        one, two = canonical(doc()), canonical(doc(extra=True))
        first = await store.save_definition("doc", content_hash(one), one)
        again = await store.save_definition("doc", content_hash(one), one)
        second = await store.save_definition("doc", content_hash(two), two)
        other = await store.save_definition("other", content_hash(one), one)
        assert (first.version, first.new) == (1, True)
        assert (again.version, again.new) == (1, False) and again == first
        assert (second.version, second.new) == (2, True)
        assert (other.version, other.new) == (1, True)
        assert dict(first.definition) == one and first.created_at is not None
        listed = await store.definitions()
        assert [(v.workflow, v.version, v.instances) for v in listed] == [
            ("doc", 1, 0),
            ("doc", 2, 0),
            ("other", 1, 0),
        ]
        assert [v.version for v in await store.definitions("doc")] == [1, 2]
        found = await store.definition("doc", 2)
        assert found is not None and found.hash == content_hash(two)
        assert dict(found.definition) == two
        assert await store.definition("doc", 3) is None
    finally:
        await store.aclose()


async def test_register_stores_versions_and_pins_instances(
    engine: flowlock.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """An identical register is a no-op (same version, not new); a changed one is the next
    version; instances and their rows carry the version they run; an old instance keeps its
    own version's rules while new ones get the newest; definitions() counts them."""
    caplog.set_level(logging.INFO, logger="flowlock")
    v1 = await engine.register(doc())
    assert v1 == 1 and (v1.version, v1.new) == (1, True)
    assert "workflow 'doc' version 1 (new)" in caplog.text
    same = await engine.register(doc())
    assert (same.version, same.new) == (1, False)
    assert "workflow 'doc' version 1 (unchanged)" in caplog.text
    old = await engine.create("doc", instance_id="old")
    assert old.definition_version == 1
    await engine.fire("old", "submit")
    await engine.fire("old", "approve")

    v2 = await engine.register(doc(extra=True))
    assert (v2.version, v2.new) == (2, True)
    new = await engine.create("doc", instance_id="new")
    assert new.definition_version == 2
    # The old instance runs version 1, which has no "reopen"; the new one runs version 2.
    with pytest.raises(flowlock.UnknownEvent):
        await engine.fire("old", "reopen")
    for event in ("submit", "approve", "reopen"):
        await engine.fire("new", event)
    assert [e.definition_version for e in await engine.history("old")] == [1, 1]
    assert [e.definition_version for e in await engine.history("new")] == [2, 2, 2]
    assert (await engine.get("old")).definition_version == 1
    pinned = await engine.create("doc", instance_id="pinned", version=1)
    assert pinned.definition_version == 1
    counts = {v.version: v.instances for v in await engine.definitions("doc")}
    assert counts == {1: 2, 2: 1}
    page = await engine.list(workflow="doc")
    assert {i.id: i.definition_version for i in page} == {"new": 2, "old": 1, "pinned": 1}


async def test_an_engine_without_the_instances_version_refuses_and_writes_nothing(
    store_factory: StoreFactory,
) -> None:
    """An engine that registered only version 2 refuses a version-1 instance with
    DefinitionMismatch (for every strategy), and the instance, its history and its version are
    unchanged; a create asking for an unregistered version is refused before anything is
    written."""
    async with flowlock.Engine(store_factory()) as first:
        await first.register(doc())
        await first.create("doc", instance_id="a")
        await first.fire("a", "submit")
    async with flowlock.Engine(store_factory()) as second:
        assert await second.register(doc(extra=True)) == 2
        before = await second.get("a")
        for strategy in ("optimistic", "pessimistic"):
            with pytest.raises(flowlock.DefinitionMismatch) as caught:
                await second.fire("a", "approve", strategy=strategy)
            err = caught.value
            assert (err.instance_id, err.workflow, err.version, err.registered) == (
                "a",
                "doc",
                1,
                (2,),
            )
        after = await second.get("a")
        assert (after.version, after.state, after.definition_version) == (2, "review", 1)
        assert after.updated_at == before.updated_at
        assert len(await second.history("a")) == 1
        with pytest.raises(flowlock.DefinitionMismatch):
            await second.create("doc", instance_id="b", version=1)
        with pytest.raises(flowlock.DefinitionMismatch):
            await second.create("doc", instance_id="b", version=7)
        with pytest.raises(flowlock.InstanceNotFound):
            await second.get("b")
        # Registering version 1's code too makes this engine run it.
        await second.register(doc())
        await second.register(doc(extra=True))
        assert (await second.fire("a", "approve")).applied
        assert (await second.history("a"))[-1].definition_version == 1


async def test_register_before_open_is_stored_when_the_engine_opens(
    store_factory: StoreFactory,
) -> None:
    """register() before open() stores nothing and answers version 0; open() stores it, so a
    create pins the stored version."""
    engine = flowlock.Engine(store_factory())
    early = await engine.register(doc())
    assert (early.version, early.new) == (0, False) and early.hash == content_hash(doc())
    async with engine:
        made = await engine.create("doc", instance_id="x")
        assert made.definition_version == 1
        assert [v.version for v in await engine.definitions()] == [1]


async def test_register_warns_about_instances_in_states_the_new_version_lacks(
    engine: flowlock.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A new version without a state that instances sit in is registered, with a warning that
    counts them and says what to do."""
    await engine.register(doc())
    await engine.create("doc", instance_id="a")
    await engine.fire("a", "submit")
    caplog.set_level(logging.WARNING, logger="flowlock")
    assert await engine.register(doc(drop_review=True)) == 2
    assert "1 instance(s) of workflow 'doc' are in states version 2 lacks (review)" in caplog.text


async def test_concurrent_registers_of_one_new_definition_give_one_version(
    store_factory: StoreFactory,
) -> None:
    """20 engines registering the same new definition at once store it once: every answer is
    version 1 and exactly one is new; two different definitions at once get two numbers."""
    engines = [flowlock.Engine(store_factory(pool_size=1)) for _ in range(20)]
    try:
        await asyncio.gather(*(e.open() for e in engines))
        answers = await asyncio.gather(*(e.register(doc()) for e in engines))
        assert {a.version for a in answers} == {1}
        assert sum(a.new for a in answers) == 1
        mixed = await asyncio.gather(
            *(
                e.register(doc(extra=i % 2 == 0, drop_review=i % 2 == 1))
                for i, e in enumerate(engines)
            )
        )
        assert sorted({m.version for m in mixed}) == [2, 3]
        assert sum(m.new for m in mixed) == 2
        assert [v.version for v in await engines[0].definitions("doc")] == [1, 2, 3]
    finally:
        await asyncio.gather(*(e.aclose() for e in engines))


async def test_repairs_run_the_instances_version(store_factory: StoreFactory) -> None:
    """A force is decided with the instance's own version (its states) and stamped with it; an
    engine without that version refuses a force with DefinitionMismatch but may still pause and
    resume the instance (they keep state and data), each row stamped with the instance's
    version."""
    async with flowlock.Engine(store_factory()) as first:
        await first.register(doc())
        await first.create("doc", instance_id="a")
        forced = await first.force("a", "review", reason="stuck", actor="ops")
        assert forced.applied and forced.instance.definition_version == 1
    async with flowlock.Engine(store_factory()) as second:
        await second.register(doc(drop_review=True))  # version 2 only
        with pytest.raises(flowlock.DefinitionMismatch):
            await second.force("a", "draft", reason="x", actor="ops")
        await second.pause("a", reason="deploy", actor="ops")
        await second.resume("a", actor="ops")
        rows = await second.history("a")
        assert [(e.kind, e.definition_version) for e in rows] == [
            ("forced", 1),
            ("pause", 1),
            ("resume", 1),
        ]
        assert (await second.get("a")).definition_version == 1


async def test_a_per_transition_strategy_is_the_instances_versions(
    store_factory: StoreFactory,
) -> None:
    """Version 1 fires `submit` pessimistically, version 2 optimistically: an instance pinned to
    version 1 is fired under version 1's strategy, a new one under version 2's."""

    def doc_with(strategy: Literal["optimistic", "pessimistic"]) -> flowlock.Workflow:
        return flowlock.Workflow(
            "doc",
            states=["draft", "review"],
            initial="draft",
            transitions=[
                flowlock.Transition("submit", source="draft", target="review", strategy=strategy)
            ],
        )

    async with flowlock.Engine(store_factory()) as engine:
        assert await engine.register(doc_with("pessimistic")) == 1
        await engine.create("doc", instance_id="old")
        assert await engine.register(doc_with("optimistic")) == 2
        await engine.create("doc", instance_id="new")
        old = await engine.fire("old", "submit")
        new = await engine.fire("new", "submit")
        assert (old.strategy, old.instance.definition_version) == ("pessimistic", 1)
        assert (new.strategy, new.instance.definition_version) == ("optimistic", 2)
