"""The engine's line of callers waiting for a slot: one release notice wakes one waiter."""

from __future__ import annotations

import asyncio

from flowlock._constraints import SlotWaits


async def test_a_notice_wakes_the_first_waiter_not_woken_yet() -> None:
    """Each release wakes one waiter, in the order they lined up; other keys hear nothing."""
    waits = SlotWaits()
    with (
        waits.watch("k", "a") as first,
        waits.watch("k", "a") as second,
        waits.watch("k", "b") as elsewhere,
    ):
        waits.heard("k", "a")
        assert first.freed.is_set() and not second.freed.is_set()
        waits.heard("k", "a")
        assert second.freed.is_set() and not elsewhere.freed.is_set()


async def test_a_notice_nobody_can_take_is_kept_for_the_next_wait() -> None:
    """With every waiter awake, a notice is kept as a spare, taken once."""
    waits = SlotWaits()
    with waits.watch("k", "a") as only:
        waits.heard("k", "a")
        waits.heard("k", "a")
        assert only.freed.is_set()
        assert waits.spare("k", "a") and not waits.spare("k", "a")


async def test_a_waiter_that_leaves_with_a_notice_passes_it_on() -> None:
    """A caller leaving with a notice unspent (an error, a timeout) hands it to the next."""
    waits = SlotWaits()
    with waits.watch("k", "a") as stays:
        with waits.watch("k", "a") as leaves:
            waits.heard("k", "a")  # to `stays`, first in line
            stays.use()  # its attempt is under way with that notice
            waits.heard("k", "a")  # to `leaves`
            leaves.use()
        # `leaves` left mid-attempt: its notice goes back to the line, to `stays`.
        assert stays.freed.is_set()


async def test_anything_freed_wakes_everyone() -> None:
    """("", "") (a LISTEN opened again, a poll) wakes every waiter of every key."""
    waits = SlotWaits()
    with waits.watch("k", "a") as one, waits.watch("j", "b") as two:
        waits.heard("", "")
        await asyncio.wait_for(one.freed.wait(), 1)
        await asyncio.wait_for(two.freed.wait(), 1)
