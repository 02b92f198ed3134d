"""Firing inside `transaction.atomic()` on Django's own connection (and on a raw psycopg 3
connection): the transition commits or rolls back with the caller's own rows, checked from
another connection; refusals change nothing; concurrent atomic blocks on one instance apply
each transition exactly once (checked by flowlock's checker)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import UTC
from typing import Any

import dj_kit
import psycopg
import pytest

import flowlock
from flowlock.checker import check

pytestmark = pytest.mark.usefixtures("django_project")


def _iid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _seen(iid: str) -> tuple[str | None, int, int, int]:
    """From a connection of its own: the instance's state and version (None, 0 when it does
    not exist), its history rows and the project's order rows for it."""
    with dj_kit.other_connection() as conn:
        row = conn.execute(
            "SELECT state, version FROM flowlock_instances WHERE id = %s", (iid,)
        ).fetchone()
        history = conn.execute(
            "SELECT count(*) FROM flowlock_history WHERE instance_id = %s", (iid,)
        ).fetchone()
        orders = conn.execute(
            "SELECT count(*) FROM djapp_order WHERE instance_id = %s", (iid,)
        ).fetchone()
    assert history is not None and orders is not None
    state, version = (row[0], row[1]) if row is not None else (None, 0)
    return state, version, history[0], orders[0]


def test_commit_keeps_the_row_and_the_transition() -> None:
    from django.db import connection, transaction
    from djapp.models import Order

    from flowlock.contrib.django import engine

    iid = _iid("commit")
    with transaction.atomic():
        Order.objects.create(instance_id=iid, note="made with it")
        made = engine().create("approval", instance_id=iid, connection=connection)
        outcome = engine().fire(iid, "approve", actor="alice", connection=connection)
        # Not committed yet: another connection sees neither.
        assert _seen(iid) == (None, 0, 0, 0)
    assert made.version == 1
    assert outcome.applied and outcome.instance.state == "approved"
    assert outcome.instance.updated_at is not None
    assert outcome.instance.updated_at.tzinfo == UTC  # whatever TIME_ZONE says
    assert _seen(iid) == ("approved", 2, 1, 1)
    [entry] = engine().history(iid)
    assert (entry.event, entry.actor, entry.from_state) == ("approve", "alice", "pending")


def test_an_exception_rolls_back_both() -> None:
    from django.db import connection, transaction
    from djapp.models import Order

    from flowlock.contrib.django import engine

    iid = _iid("rollback")
    engine().create("approval", instance_id=iid)

    def view() -> None:
        with transaction.atomic():
            Order.objects.create(instance_id=iid)
            outcome = engine().fire(iid, "approve", connection=connection, request_id="r-1")
            assert outcome.applied
            raise RuntimeError("the view failed after both")

    with pytest.raises(RuntimeError, match="after both"):
        view()
    assert _seen(iid) == ("pending", 1, 0, 0)
    # Nothing of it is remembered: the same request applies afresh.
    again = engine().fire(iid, "approve", request_id="r-1")
    assert again.applied and not again.replayed
    assert _seen(iid) == ("approved", 2, 1, 0)


def test_a_refused_transition_leaves_the_callers_transaction_usable() -> None:
    from django.db import connection, transaction
    from djapp.models import Order

    from flowlock.contrib.django import engine

    iid = _iid("refused")
    engine().create("approval", instance_id=iid)
    engine().fire(iid, "reject")
    with transaction.atomic():
        Order.objects.create(instance_id=iid, note="before")
        with pytest.raises(flowlock.TransitionNotAllowed):
            engine().fire(iid, "approve", connection=connection)
        Order.objects.create(instance_id=iid, note="after")  # the transaction goes on
    assert _seen(iid) == ("rejected", 2, 1, 2)


def test_a_raw_psycopg_connection_commits_and_rolls_back_with_its_rows(
    django_project: str,
) -> None:
    from flowlock.contrib.django import engine

    kept, undone = _iid("raw-kept"), _iid("raw-undone")
    for iid in (kept, undone):
        engine().create("approval", instance_id=iid)
    insert = "INSERT INTO djapp_order (instance_id, note) VALUES (%s, 'raw')"
    with psycopg.connect(dj_kit.url()) as conn:
        conn.execute(f'SET search_path = "{django_project}"')
        conn.commit()
        with conn.transaction():
            conn.execute(insert, (kept,))
            assert engine().fire(kept, "approve", connection=conn).applied

        def undo() -> None:
            with conn.transaction():
                conn.execute(insert, (undone,))
                assert engine().fire(undone, "approve", connection=conn).applied
                raise RuntimeError("undo")

        with pytest.raises(RuntimeError):
            undo()
        # autocommit off: psycopg's own implicit transaction, ended by commit().
        conn.execute(insert, (undone,))
        assert engine().fire(undone, "reject", connection=conn).applied
        conn.commit()
    assert _seen(kept) == ("approved", 2, 1, 1)
    assert _seen(undone) == ("rejected", 2, 1, 1)


def _refused(connection: object, match: str) -> None:
    from flowlock.contrib.django import engine

    iid = _iid("refuse")
    engine().create("approval", instance_id=iid)
    with pytest.raises(flowlock.InvalidInput, match=match):
        engine().fire(iid, "approve", connection=connection)
    with pytest.raises(flowlock.InvalidInput, match=match):
        engine().create("approval", instance_id=iid + "-2", connection=connection)
    assert _seen(iid) == ("pending", 1, 0, 0)
    assert _seen(iid + "-2") == (None, 0, 0, 0)


def test_refuses_a_django_connection_outside_atomic() -> None:
    from django.db import connection

    _refused(connection, "inside transaction.atomic")


def test_refuses_an_atomic_block_marked_for_rollback() -> None:
    from django.db import connection, transaction

    from flowlock.contrib.django import engine

    engine().create("approval", instance_id="dup-" + uuid.uuid4().hex)
    with transaction.atomic():
        try:
            with transaction.atomic(savepoint=False), connection.cursor() as cur:
                cur.execute("SELECT 1/0")
        except Exception:
            pass
        _refused(connection, "marked for rollback")


def test_refuses_connections_of_other_kinds() -> None:
    _refused("postgresql://postgres@127.0.0.1/test", "psycopg 3 connection")
    with psycopg.connect(dj_kit.url(), autocommit=True) as conn:
        _refused(conn, "inside a transaction you opened")
    with psycopg.connect(dj_kit.url()) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        _refused(conn, "already failed")


def _threads(n: int, work: Callable[[int], Any]) -> list[Any]:
    """`work(i)` on `n` threads started together; each result or error, in order."""
    from django.db import connection

    start = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            start.wait(10)
            results[i] = work(i)
        except Exception as exc:
            results[i] = exc
        finally:
            connection.close()  # this thread's own Django connection

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_atomic_blocks_apply_one_transition_once() -> None:
    from django.db import connection, transaction
    from djapp.models import Order

    from flowlock.contrib.django import engine

    iid = _iid("race")
    engine().create("approval", instance_id=iid)

    def decide(i: int) -> flowlock.Outcome:
        # Half approve, half reject: one decision wins, whichever it is.
        event = "approve" if i % 2 else "reject"
        with transaction.atomic():
            Order.objects.create(instance_id=iid, note=f"caller {i}")
            return engine().fire(iid, event, actor=f"caller-{i}", connection=connection)

    results = _threads(8, decide)
    outcomes = [r for r in results if isinstance(r, flowlock.Outcome)]
    applied = [r for r in outcomes if r.applied]
    failed = [r for r in results if not isinstance(r, flowlock.Outcome)]
    assert len(applied) == 1, results
    won = applied[0].instance.state
    # The others saw the decision made (the same one: idempotent, their block commits) or lost
    # to it inside their transaction (refused: their block, and their own row, rolled back).
    assert all(not r.applied and r.instance.state == won for r in outcomes if r is not applied[0])
    assert all(
        isinstance(r, flowlock.TransitionNotAllowed | flowlock.ConflictRetriesExhausted)
        for r in failed
    ), failed
    assert _seen(iid) == (won, 2, 1, len(outcomes)), results
    inst = engine().get(iid)
    verdict = check(inst, engine().history(iid), initial_state="pending", expected_applied=1)
    assert verdict.ok, verdict.violations


def test_concurrent_atomic_blocks_each_apply_once_with_retries() -> None:
    from django.db import connection, transaction
    from djapp.models import Order

    from flowlock.contrib.django import engine

    iid = _iid("tally")
    engine().create("tally", instance_id=iid)
    per_thread, n = 5, 8

    def count(i: int) -> int:
        done = 0
        for k in range(per_thread):
            for _ in range(200):  # a lost compare-and-swap: the whole block again
                try:
                    with transaction.atomic():
                        Order.objects.create(instance_id=iid, note=f"{i}.{k}")
                        engine().fire(iid, "count", request_id=f"c-{i}-{k}", connection=connection)
                    done += 1
                    break
                except flowlock.ConflictRetriesExhausted:
                    continue
        return done

    results = _threads(n, count)
    assert results == [per_thread] * n, results
    state, version, history, orders = _seen(iid)
    assert (state, version, history, orders) == (
        "open",
        1 + n * per_thread,
        n * per_thread,
        n * per_thread,
    )
    verdict = check(
        engine().get(iid),
        engine().history(iid),
        initial_state="open",
        expected_applied=n * per_thread,
    )
    assert verdict.ok, verdict.violations


def test_force_commits_and_rolls_back_with_the_callers_rows() -> None:
    from django.db import connection, transaction
    from djapp.models import Order

    from flowlock.contrib.django import engine

    iid = _iid("force")
    engine().create("approval", instance_id=iid)

    def repair(fail: bool) -> None:
        with transaction.atomic():
            Order.objects.create(instance_id=iid, note="repair ticket")
            forced = engine().force(
                iid, "archived", reason="ticket OPS-3", actor="ops", connection=connection
            )
            assert forced.applied
            if fail:
                raise RuntimeError("the ticket could not be closed")

    with pytest.raises(RuntimeError):
        repair(fail=True)
    assert _seen(iid) == ("pending", 1, 0, 0)
    repair(fail=False)
    assert _seen(iid) == ("archived", 2, 1, 1)
    [entry] = engine().history(iid)
    assert entry.forced and (entry.reason, entry.actor) == ("ticket OPS-3", "ops")
