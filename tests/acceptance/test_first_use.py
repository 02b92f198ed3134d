"""What a new user tried first, kept true: the examples carry the strategy that fits them, so the
stock example never leaves units unsold under a crowd; the submodules a user reaches for import
with ``flowlock``."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

import flowlock
from flowlock import examples
from flowlock.checker import check


def test_each_example_carries_the_strategy_that_fits_it() -> None:
    assert examples.approval().strategy is None  # the engine's default: any strategy fits
    assert examples.countersign(3).strategy == "pessimistic"
    assert examples.inventory().strategy == "pessimistic"
    # An explicit choice (or None, the engine's default) still wins.
    assert examples.inventory(strategy="adaptive").strategy == "adaptive"
    assert examples.countersign(3, strategy=None).strategy is None


async def test_100_buyers_for_50_units_sell_exactly_50_on_the_engines_default(
    pg_engine_factory: Callable[..., Any], sql_history: Callable[..., Any]
) -> None:
    """The engine's default strategy is optimistic; the inventory example's own pessimistic
    strategy takes over, so every buyer gets an answer: 50 reservations, 50 out-of-stock
    refusals, no ConflictRetriesExhausted and no unsold unit (the first version sold 24)."""
    engine = await pg_engine_factory()
    assert engine.strategies["optimistic"] is not None
    await engine.create("inventory", instance_id="stock", data={"stock": 50, "reserved": 0})
    start = asyncio.Event()

    async def buy(n: int) -> str:
        await start.wait()
        try:
            outcome = await engine.fire("stock", "reserve", actor=f"buyer-{n}")
        except flowlock.GuardRejected:
            return "refused"
        except flowlock.FlowlockError as exc:
            return type(exc).__name__
        assert outcome.strategy == "pessimistic"
        return "applied"

    buyers = [asyncio.create_task(buy(n)) for n in range(100)]
    await asyncio.sleep(0)
    start.set()
    answers = await asyncio.gather(*buyers)
    assert answers.count("applied") == 50, sorted(set(answers))
    assert answers.count("refused") == 50, sorted(set(answers))
    stock = await engine.get("stock")
    assert stock.data == {"stock": 0, "reserved": 50}
    history = await engine.history("stock")
    assert check(stock, history, initial_state="open", expected_applied=50).ok
    (await sql_history()).assert_matches({"stock": history})


@pytest.mark.parametrize("module", ["checker", "jobs", "sync", "examples", "errors"])
def test_submodules_import_with_flowlock(module: str) -> None:
    """``import flowlock`` is enough to reach its public submodules as attributes."""
    probe = f"import flowlock; print(flowlock.{module}.__name__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"flowlock.{module}"


def test_the_runner_module_is_gone() -> None:
    """flowlock.runner, the jobs module's old name, was removed in 0.2.0."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flowlock.runner")
    assert flowlock.jobs.RunOnce is flowlock.RunOnce
