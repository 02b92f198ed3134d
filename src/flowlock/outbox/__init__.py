"""The transactional outbox: what a transition must cause outside the database, done exactly once
per message key. The dispatcher (`flowlock.outbox.dispatcher`) runs the handlers registered with
`engine.on_emit`; `webhook` and `log` are handlers ready to register.
"""

from __future__ import annotations

from flowlock.core.outbox import Emit, Message, Then

__all__ = ["Emit", "Message", "Then"]
