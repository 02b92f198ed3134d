"""What the outbox tests share: two workflows that emit, and waiting for a message's status.

- ``noter``: ``note`` stays in ``open`` and emits ``count`` messages (payload ``{"i": i}``) of
  kind ``kind`` (payload keys of the call, defaults 1 and ``"k"``);
- ``shop``: ``reserve`` (a caller) emits ``charge``; ``charged`` emits ``ship``; ``shipped``
  ends it: the chain a handler's ``Then`` drives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flowlock
from lock_probes import wait_until

__all__ = ["noted", "noter", "shop", "status_is"]


def _note(inst: flowlock.Instance, payload: Mapping[str, Any], actor: str | None) -> Any:
    kind, count = payload.get("kind", "k"), payload.get("count", 1)
    emits = [flowlock.Emit(kind, {"i": i}) for i in range(count)]
    return flowlock.Step({"notes": inst.data.get("notes", 0) + 1}, emit=emits)


def noter() -> flowlock.Workflow:
    return flowlock.Workflow(
        "noter",
        states=["open"],
        initial="open",
        policy="inventory",
        transitions=[flowlock.Transition("note", source="open", target="open", effect=_note)],
    )


def _emits(kind: str) -> Callable[[flowlock.Instance, Mapping[str, Any], str | None], Any]:
    return lambda inst, payload, actor: [flowlock.Emit(kind, {"order": inst.id})]


def shop() -> flowlock.Workflow:
    return flowlock.Workflow(
        "shop",
        states=["new", "reserved", "charged", "shipped"],
        initial="new",
        transitions=[
            flowlock.Transition("reserve", source="new", target="reserved", emit=_emits("charge")),
            flowlock.Transition(
                "charged", source="reserved", target="charged", emit=_emits("ship")
            ),
            flowlock.Transition("shipped", source="charged", target="shipped"),
        ],
    )


async def noted(engine: flowlock.Engine, instance_id: str, **payload: Any) -> None:
    """Fire ``note`` at the noter ``instance_id``, created first when it does not exist."""
    try:
        await engine.get(instance_id)
    except flowlock.InstanceNotFound:
        await engine.create("noter", instance_id=instance_id)
    await engine.fire(instance_id, "note", payload=payload)


async def status_is(
    engine: flowlock.Engine, key: str, status: str, *, within: float = 10.0
) -> flowlock.Message:
    """The message of `key` once it has `status` (it may not be emitted yet when called)."""
    found: list[flowlock.Message] = []

    async def there() -> bool:
        try:
            message = await engine.message(key)
        except flowlock.MessageNotFound:
            return False
        found[:] = [message]
        return message.status == status

    await wait_until(there, within=within, what=f"message {key} {status}")
    return found[0]
