"""The PostgreSQL store's constraint statements, without a server: which text a commit sends,
that its parameters line up, that every name is qualified behind a transaction pooler, and what
the refusal's SQLSTATE becomes."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import asyncpg
import pytest

import flowlock
from flowlock._pg.errors import broken, translate
from flowlock.core.constraints import Claim
from flowlock.core.errors import StoreError
from flowlock.core.models import HistoryEntry
from flowlock.core.outbox import Emit
from flowlock.stores.postgres import constraints, retention
from flowlock.stores.postgres import sql as statements
from flowlock.stores.postgres.constraint_sql import CLAIM_ARRAYS, claim_args
from flowlock.stores.postgres.session import context_of
from flowlock.stores.postgres.sql import CAS, CAS_BATCH, CAS_MANY, cas_of, many_of, qualified

TAKE = (Claim("take", "w.busy", "bob", 2),)


def entry(iid: str, version: int, claims: tuple[Claim, ...] = ()) -> HistoryEntry:
    return HistoryEntry(
        instance_id=iid,
        version=version,
        event="go",
        from_state="a",
        to_state="busy",
        actor=None,
        request_id=None,
        strategy="optimistic",
        data={},
        claims=claims,
    )


def highest_parameter(text: str) -> int:
    return max(int(n) for n in re.findall(r"\$(\d+)", text))


def test_a_commit_without_claims_sends_the_statement_it_always_did() -> None:
    """No claim: the one-entry, batch and many-instance statements are the plain texts, with
    no claims' arrays; claim_args has nothing to build."""
    one = (entry("i", 2),)
    assert cas_of(one)[0] == CAS
    assert cas_of((entry("i", 2), entry("i", 3)))[0] == CAS_BATCH
    assert many_of([one, (entry("j", 2),)])[0] == CAS_MANY
    assert claim_args([one]) is None


def extras(e: HistoryEntry, timed: bool, emits: bool) -> HistoryEntry:
    """`e` ending its stay's timers and emitting a message, as asked."""
    return dataclasses.replace(e, voids=timed, emits=(Emit("note"),) if emits else ())


@pytest.mark.parametrize("timed", [False, True], ids=["", "timed"])
@pytest.mark.parametrize("emits", [False, True], ids=["", "emits"])
@pytest.mark.parametrize(
    "batches",
    [
        [(entry("i", 2, TAKE),)],
        [(entry("i", 2), entry("i", 3, TAKE))],
        [(entry("i", 2, TAKE),), (entry("j", 2),)],
    ],
    ids=["one", "batch", "many"],
)
def test_a_commit_with_claims_calls_the_function_with_aligned_arrays(
    batches: list[tuple[HistoryEntry, ...]], timed: bool, emits: bool
) -> None:
    """With a claim anywhere, the variant that calls flowlock_claims is sent, reading every
    argument it is given (the claims' arrays last, one element per claim), with timers and
    messages in the same statement or not."""
    batches = [tuple(extras(e, timed, emits) for e in batch) for batch in batches]
    text, args = cas_of(batches[0]) if len(batches) == 1 else many_of(batches)
    assert "flowlock_claims(" in text and "CROSS JOIN claimed" in text
    assert ("timers_dropped" in text) == timed and ("outboxed" in text) == emits
    assert highest_parameter(text) == len(args)
    claims = args[-CLAIM_ARRAYS:]
    assert claims[0] == ["i"] and claims[3] == ["take"] and claims[5] == ["bob"]


def _texts() -> list[str]:
    found = [
        v
        for module in (statements, constraints)
        for k, v in vars(module).items()
        if k.isupper() and isinstance(v, str)
    ]
    return [*found, retention._PURGE, cas_of((entry("i", 2, TAKE),))[0]]


def test_the_constraint_functions_and_tables_are_named_with_the_schema() -> None:
    """Behind a transaction pooler (no search_path) every statement names the constraint
    tables and functions with the schema."""
    names = ("claims", "free_slots", "capacity", "slots", "slot_log", "rate_log")
    texts = _texts()
    assert any("flowlock_claims(" in t for t in texts)
    assert any("flowlock_free_slots(" in t for t in texts)
    for text in texts:
        done = qualified(text, "s")
        for name in names:
            assert not re.findall(rf'(?<![\w."])flowlock_{name}\b(?!\.)', done), (name, done)


def _refusal(facts: dict[str, Any] | str) -> BaseException:
    detail = facts if isinstance(facts, str) else json.dumps(facts)
    return asyncpg.PostgresError.new({"C": "FL028", "M": "refused", "D": detail})


FACTS = {"instance_id": "i", "version": 3, "event": "go", "kind": "k", "key": "bob", "limit": 2}


def test_the_refusal_becomes_its_typed_error() -> None:
    """SQLSTATE FL028 with its facts becomes CapacityReached, UniqueViolation or RateLimited,
    with the entry's version and event; the connection stays usable."""
    ctx = context_of("i")
    full = _refusal({**FACTS, "rule": "capacity", "holders": ["a", "b"]})
    capacity = translate(full, context=ctx)
    assert isinstance(capacity, flowlock.CapacityReached)
    assert (capacity.holders, capacity.version, capacity.event) == (("a", "b"), 3, "go")
    unique = translate(_refusal({**FACTS, "rule": "unique", "holders": ["a"]}), context=ctx)
    assert isinstance(unique, flowlock.UniqueViolation) and unique.holder == "a"
    rate = translate(
        _refusal({**FACTS, "rule": "rate", "per": 60.0, "retry_after": 1.5}), context=ctx
    )
    assert isinstance(rate, flowlock.RateLimited) and (rate.per, rate.retry_after) == (60, 1.5)
    assert not broken(_refusal({**FACTS, "rule": "capacity", "holders": []}))


def test_a_refusal_whose_facts_cannot_be_read_is_a_store_error() -> None:
    """Facts that are not the function's JSON are a StoreError saying nothing was written."""
    found = translate(_refusal("not json"), context=context_of("i"))
    assert isinstance(found, StoreError) and "nothing was written" in str(found)
