"""Handlers ready to register with `engine.on_emit`: `webhook` (POST each message to a URL) and
`log` (for development).

httpx (the `webhook` extra) is imported when a webhook first sends, not before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from flowlock.core.errors import DeliveryFailed, DeliveryRefused, InvalidInput
from flowlock.core.extras import require
from flowlock.core.outbox import Message, Then
from flowlock.core.settings import check_seconds, check_url

if TYPE_CHECKING:
    import httpx

__all__ = ["FENCING_HEADER", "IDEMPOTENCY_HEADER", "Webhook", "log", "webhook"]

logger = logging.getLogger("flowlock.outbox")

IDEMPOTENCY_HEADER = "Idempotency-Key"
"""The header a webhook puts the message key in: the same on every redelivery."""
FENCING_HEADER = "Flowlock-Fencing-Token"
"""The header a webhook puts the message's fencing token in, when it has one."""

# Answers worth trying again: the receiver timed out or is rate limiting (4xx) or failed (5xx).
_RETRIED_4XX = (408, 429)
_SHOWN = 200  # characters of a refusing answer's body kept in the error

ThenFn = Callable[[Message, "httpx.Response"], "Then | None"]


async def log(message: Message) -> None:
    """Log the message at INFO on the `flowlock.outbox` logger; nothing else (for development)."""
    logger.info(
        "flowlock outbox: %s %s (attempt %d) payload=%s",
        message.kind, message.key, message.attempt, json.dumps(dict(message.payload)),
    )  # fmt: skip


def webhook(
    url: str,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
    *,
    then: ThenFn | None = None,
) -> Webhook:
    """A handler that POSTs each message as JSON to `url`, with its key in an
    `Idempotency-Key` header (and its fencing token in `Flowlock-Fencing-Token`, when it has one).

    The body is `{"key", "kind", "instance_id", "version", "payload", "attempt",
    "fencing_token"}`. A 2xx answer is done; a 408, 429 or 5xx answer, a timeout (`timeout`
    seconds) or a connection error is retried (after the `Retry-After` the receiver asked
    for, capped by the dispatcher's backoff); any other answer is refused for good (dead).
    `then(message, response)` may turn a 2xx answer into a `flowlock.Then`. Needs the
    `webhook` extra (httpx).
    """
    return Webhook(url, headers, timeout, then=then)


class Webhook:
    """The handler `webhook()` returns. It keeps one HTTP client (per event loop), made on
    the first delivery and closed when an engine that runs it closes (`aclose`)."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        *,
        then: ThenFn | None = None,
    ) -> None:
        self.url = check_url("url", url, ("http", "https"))
        if headers is not None and (
            not isinstance(headers, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise InvalidInput(f"headers must map header names to strings, not {headers!r}")
        self.headers = dict(headers or {})
        self.timeout = check_seconds("timeout", timeout)
        if then is not None and not callable(then):
            raise InvalidInput(f"then must be a callable then(message, response), not {then!r}")
        self._then = then
        # Imported here, not with flowlock.outbox: only a webhook needs it; missing, the
        # registration fails, not each delivery.
        self._httpx: Any = require("httpx", "webhook", "flowlock.outbox.webhook")
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def __repr__(self) -> str:
        return f"flowlock.outbox.webhook({self.url!r})"

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = self._httpx.AsyncClient(timeout=self.timeout, follow_redirects=False)
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop (a later delivery makes another)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def __call__(self, message: Message) -> Then | None:
        client, httpx = self._client(), self._httpx
        body = {
            "key": message.key,
            "kind": message.kind,
            "instance_id": message.instance_id,
            "version": message.version,
            "payload": dict(message.payload),
            "attempt": message.attempt,
            "fencing_token": message.fencing_token,
        }
        headers = {**self.headers, IDEMPOTENCY_HEADER: message.key}
        if message.fencing_token is not None:
            headers[FENCING_HEADER] = str(message.fencing_token)
        try:
            response = await client.post(self.url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise DeliveryFailed(f"POST {self.url} timed out after {self.timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise DeliveryFailed(f"POST {self.url} failed: {exc!r}") from exc
        status = response.status_code
        if 200 <= status < 300:
            return None if self._then is None else self._then(message, response)
        said = f"POST {self.url} answered {status}: {response.text[:_SHOWN]}"
        if status >= 500 or status in _RETRIED_4XX:
            raise DeliveryFailed(said, retry_after=retry_after(response.headers.get("Retry-After")))
        raise DeliveryRefused(said)


def retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """The seconds an HTTP `Retry-After` header asks for (a number of seconds or an HTTP
    date), or None when it is missing or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None
