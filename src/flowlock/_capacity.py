"""What `GET /capacity/{kind}/{key}` and `flowlock capacity` show: who holds the slots of one
key, and its limit.

`engine.capacity` knows the rules of the workflows registered on the engine. The command line
registers none, so the rule is then read from the stored definitions (their canonical form
names each constraint's kind, rule, limit and window).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from flowlock.core.constraints import CapacityUsage
from flowlock.engine import Engine
from flowlock.stores.constraint_store import ConstraintStore

__all__ = ["capacity_of", "known_kinds", "usage_dict"]

RuleName = Literal["capacity", "unique", "rate"]
_RULES: tuple[RuleName, ...] = ("capacity", "unique", "rate")


async def capacity_of(engine: Engine, kind: str, key: str) -> CapacityUsage:
    """`engine.capacity(kind, key)`, its rule (and a rate's window) read from the newest stored
    definition naming `kind` when no workflow registered here has it. `limit` and `rule` stay
    None when neither a rule nor a stored row knows the kind."""
    usage = await engine.capacity(kind, key)
    if usage.rule is not None:
        return usage
    stored = await _stored_rule(engine, kind)
    if stored is None:
        return usage
    rule, limit, per = stored
    store = engine.store
    if rule == "rate" and isinstance(store, ConstraintStore):
        usage = await store.capacity_usage(kind, key, per)
    return CapacityUsage(
        kind,
        key,
        usage.limit if usage.limit is not None else limit,
        usage.holders,
        rule,
        per if rule == "rate" else None,
    )


async def _stored_rule(engine: Engine, kind: str) -> tuple[RuleName, int, float] | None:
    """(rule, limit, per) of `kind` in the newest stored definition that names it."""
    for stored in sorted(await engine.definitions(), key=lambda v: -v.version):
        for form in _constraints(stored.definition):
            rule = form.get("rule")
            if form.get("kind") == kind and rule in _RULES:
                return _RULES[_RULES.index(rule)], int(form["limit"]), float(form.get("per") or 0)
    return None


def _constraints(definition: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = definition.get("constraints")
    return [c for c in found if isinstance(c, Mapping)] if isinstance(found, list) else []


async def known_kinds(engine: Engine) -> list[str]:
    """Every constraint kind the registered workflows and stored definitions name, sorted."""
    kinds: set[str] = set()
    for wf in engine.registry.every():
        kinds.update(rule.kind for rule in wf.constraints.slots)
        kinds.update(rule.kind for rule in wf.constraints.rates)
    for stored in await engine.definitions():
        kinds.update(str(c.get("kind")) for c in _constraints(stored.definition))
    return sorted(kinds)


def usage_dict(usage: CapacityUsage) -> dict[str, Any]:
    """The usage as JSON-ready values: limit, holders (oldest first), used, free and the rule
    (a rate limit's `window` in seconds: its holders are the applications in it)."""
    return {
        "kind": usage.kind,
        "key": usage.key,
        "limit": usage.limit,
        "holders": list(usage.holders),
        "used": usage.used,
        "free": usage.free,
        "rule": usage.rule,
        "window": usage.window,
    }
