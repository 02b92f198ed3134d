"""The engine's checks of payloads and data before any I/O (a mixin of `flowlock.Engine`).

Plain JSON within `max_payload_bytes` for every call; for a typed transition (`payload=`) or
workflow (`data=`), the declared schema too. docs/payloads.md says more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowlock.core.definition import Workflow
from flowlock.core.jsondata import check_object
from flowlock.core.payloads import PayloadSchema, early_schemas
from flowlock.core.versions import Registry

__all__ = ["PayloadChecks"]


class PayloadChecks:
    """Checks the engine runs on what a caller sends, before anything is read.

    First among the engine's bases: it defines `_check_data`, which other mixins only declare.
    """

    _max_payload: int
    _workflows: Registry
    # Events whose payload is checked before the read: every workflow that defines the event
    # declares the same schema. Empty (falsy) while no transition is typed, so an untyped
    # call pays one attribute check.
    _early: Mapping[str, tuple[PayloadSchema, str]] = {}

    def _check_data(self, data: object, what: str) -> Mapping[str, Any]:
        """`data` as plain JSON within `max_payload_bytes`, or InvalidInput (see
        `flowlock.core.jsondata.check_object`, the check the step also runs on what effects
        return)."""
        return check_object(data, what, self._max_payload)

    def _index_payloads(self) -> None:
        """Which events' payloads can be checked before the read (after a register)."""
        # Every version: an instance pinned to an older one is checked against its own schema.
        self._early = early_schemas(self._workflows.every())

    def _fire_payload(
        self, event: str, payload: object
    ) -> tuple[Mapping[str, Any], tuple[object, Any] | None]:
        """The call's payload as JSON, and parsed with its schema's key when the event's
        schema is known before the read (InvalidPayload otherwise, nothing read)."""
        body = check_object(payload, "payload", self._max_payload)
        early = self._early
        if not early or event not in early:
            return body, None
        schema, workflows = early[event]
        return body, (schema.key, schema.parse(body, workflow=workflows, event=event))

    def _create_data(self, wf: Workflow, data: object) -> Mapping[str, Any]:
        """A create's data as JSON, checked against the workflow's `data=` schema if any.
        Stored as sent: the schema checks it, and never rewrites it."""
        body = check_object(data, "data", self._max_payload)
        if wf.data is not None:
            wf.data.parse(body, workflow=wf.name, event=None)
        return body
