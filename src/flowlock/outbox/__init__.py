"""The transactional outbox: what a transition must cause outside the database, done exactly once
per message key. The dispatcher (`flowlock.outbox.dispatcher`) runs the handlers registered with
`engine.on_emit`; `webhook` and `log` are handlers ready to register.

A handler raises `DeliveryFailed` (or anything) to be tried again later, `DeliveryRefused`
to give the message up at once (dead).
"""

from __future__ import annotations

from flowlock.core.errors import DeliveryFailed, DeliveryRefused
from flowlock.core.outbox import Emit, Message, Then
from flowlock.outbox.handlers import Webhook, log, webhook

__all__ = [
    "DeliveryFailed",
    "DeliveryRefused",
    "Emit",
    "Message",
    "Then",
    "Webhook",
    "log",
    "webhook",
]
