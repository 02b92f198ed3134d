"""Guards and effects must be synchronous: an ``async def`` step is refused when the workflow is
built (it used to be silently ignored: the coroutine is truthy, so the guard "passed"), and an
awaitable returned at call time is refused with nothing written and no "never awaited" warning.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections.abc import Mapping
from typing import Any, cast

import pytest

import flowlock
from flowlock.core.models import Instance
from flowlock.stores import MemoryStore


async def async_guard(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
    return False  # pragma: no cover - never called: refused at build time


async def async_effect(
    inst: Instance, payload: Mapping[str, Any], actor: str | None
) -> dict[str, Any]:
    return {}  # pragma: no cover - never called: refused at build time


async def async_guard_with_limit(
    limit: int, inst: Instance, payload: Mapping[str, Any], actor: str | None
) -> bool:
    return False  # pragma: no cover - never called: refused at build time


class AsyncCallable:
    async def __call__(self, inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        return False  # pragma: no cover - never called: refused at build time


class Holder:
    async def check(self, inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        return False  # pragma: no cover - never called: refused at build time


class SyncCallable:
    def __call__(self, inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        return True


ASYNC_STEPS = {
    "async def": async_guard,
    "partial of async def": functools.partial(async_guard_with_limit, 3),
    "partial of a partial": functools.partial(functools.partial(async_guard_with_limit), 3),
    "object with async __call__": AsyncCallable(),
    "partial of such an object": functools.partial(AsyncCallable()),
    "bound async method": Holder().check,
}


@pytest.mark.parametrize("step", ["guard", "effect"])
@pytest.mark.parametrize("kind", list(ASYNC_STEPS))
def test_async_steps_are_refused_when_built(step: str, kind: str) -> None:
    """Every shape of async callable, as a guard or an effect, raises DefinitionError saying
    steps must be synchronous and pure, and why."""
    fn: Any = ASYNC_STEPS[kind]  # typed Any: mypy itself refuses an async step as a Guard
    steps: dict[str, Any] = {"guard": None, "effect": None, step: fn}
    with pytest.raises(flowlock.DefinitionError) as caught:
        flowlock.Transition("approve", source="a", target="b", **steps)
    message = str(caught.value)
    assert f"the {step}" in message and "async" in message
    assert "synchronous" in message and "pure" in message
    assert "retry" in message and "row lock" in message and "I/O" in message


def test_async_effect_function_is_refused() -> None:
    with pytest.raises(flowlock.DefinitionError, match="effect 'async_effect' is async"):
        flowlock.Transition("approve", source="a", target="b", effect=cast(Any, async_effect))


def test_sync_callables_are_accepted() -> None:
    """Plain functions, lambdas, partials of them, callable objects and classes still build."""

    def guard(limit: int, inst: Instance, payload: Mapping[str, Any], actor: str | None) -> bool:
        return True

    accepted: list[Any] = [SyncCallable(), functools.partial(guard, 1), lambda i, p, a: True, dict]
    for fn in accepted:
        flowlock.Transition("approve", source="a", target="b", guard=fn)


def _coroutine_returning_guard() -> flowlock.Workflow:
    """A sync guard that returns a coroutine: it passes the build-time check (a wrapper hides
    the async function), so the call-time safety net must catch it."""

    def wrapper(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return async_guard(inst, payload, actor)

    def wrapped_effect(inst: Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
        return async_effect(inst, payload, actor)

    return flowlock.Workflow(
        "hidden",
        states=["a", "b"],
        initial="a",
        transitions=[
            flowlock.Transition("go", source="a", target="b", guard=wrapper),
            flowlock.Transition("run", source="a", target="b", effect=wrapped_effect),
        ],
    )


@pytest.mark.parametrize(("event", "step"), [("go", "guard"), ("run", "effect")])
@pytest.mark.parametrize("strategy", ["optimistic", "pessimistic"])
async def test_an_awaitable_result_is_refused_at_call_time(
    event: str, step: str, strategy: str
) -> None:
    """A step returning an awaitable is refused with a typed error, the coroutine is closed
    (no RuntimeWarning "never awaited") and nothing is written."""
    async with flowlock.Engine(MemoryStore()) as engine:
        await engine.register(_coroutine_returning_guard())
        await engine.create("hidden", instance_id="i", data={"n": 1})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(flowlock.DefinitionError) as refused:
                await engine.fire("i", event, strategy=strategy)
            message = str(refused.value)
            del refused  # its traceback holds the frames that held the coroutine
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], caught
        assert f"the {step} of event {event!r}" in message
        assert "awaitable" in message and "synchronous" in message
        inst = await engine.get("i")
        assert (inst.state, inst.version, dict(inst.data)) == ("a", 1, {"n": 1})
        assert await engine.history("i") == []
