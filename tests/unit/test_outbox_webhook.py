"""The webhook handler against a real HTTP server on 127.0.0.1 (http.server in a thread): what
each answer does (500, 429 with Retry-After, 400, a hang, 200), the Idempotency-Key header and
the body; and the log handler."""

from __future__ import annotations

import http.server
import json
import logging
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

import flowlock
from flowlock.outbox.handlers import retry_after
from outbox_kit import noted, noter, shop, status_is

HANG = "hang"
FAST = (0.01, 1.0)  # outbox_backoff: retries in milliseconds, any wait capped at 1 s


@dataclass
class Seen:
    """One request the server got."""

    at: float
    headers: Mapping[str, str]
    body: dict[str, Any]


@dataclass
class Script:
    """The answers the server gives, in order (then 200 for ever), and what it was sent."""

    answers: deque[tuple[int, dict[str, str], str] | str]
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        script = self.server.script
        size = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(size))
        script.seen.append(Seen(time.monotonic(), dict(self.headers.items()), body))
        answer = script.answers.popleft() if script.answers else (200, {}, "")
        if answer == HANG:
            script.release.wait(10)  # until the test ends: the client gives up long before
            return
        assert not isinstance(answer, str)
        status, headers, text = answer
        data = text.encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    script: Script


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    """A real HTTP server on 127.0.0.1 (a free port); its script is empty (200s)."""
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.script = Script(deque())
    thread = threading.Thread(
        target=srv.serve_forever, args=(0.05,), name="webhook-test-server", daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/hook", srv.script
    finally:
        srv.script.release.set()
        srv.shutdown()
        srv.server_close()
        thread.join(10)


def _message(**changes: Any) -> flowlock.Message:
    fields: dict[str, Any] = {
        "key": "order-1:3:0",
        "instance_id": "order-1",
        "workflow": "shop",
        "version": 3,
        "n": 0,
        "kind": "notify",
        "payload": {"to": "ann"},
        "status": "running",
        "attempts": 2,
        "fencing_token": 41,
    }
    fields.update(changes)
    return flowlock.Message(**fields)


async def test_each_answer_of_the_receiver(server: tuple[str, Script]) -> None:
    """500 and a hang are retried, 429 with its Retry-After, 400 is refused for good, 200 is
    done; every request carries the key as Idempotency-Key, the fencing token, and the body."""
    url, script = server
    script.answers.extend(
        [
            (500, {}, "oops"),
            (429, {"Retry-After": "7"}, "slow down"),
            (400, {}, "no such customer"),
            HANG,
            (200, {}, "ok"),
        ]
    )
    hook = flowlock.outbox.webhook(url, headers={"Authorization": "Bearer t"}, timeout=0.5)
    message = _message()
    try:
        with pytest.raises(flowlock.DeliveryFailed) as failed:
            await hook(message)
        assert not isinstance(failed.value, flowlock.DeliveryRefused)
        assert "500" in str(failed.value) and "oops" in str(failed.value)
        assert failed.value.retry_after is None
        with pytest.raises(flowlock.DeliveryFailed) as limited:
            await hook(message)
        assert not isinstance(limited.value, flowlock.DeliveryRefused)
        assert limited.value.retry_after == 7.0
        with pytest.raises(flowlock.DeliveryRefused, match="400: no such customer"):
            await hook(message)
        with pytest.raises(flowlock.DeliveryFailed, match="timed out") as hung:
            await hook(message)
        assert not isinstance(hung.value, flowlock.DeliveryRefused)
        assert await hook(message) is None
    finally:
        await hook.aclose()
    assert len(script.seen) == 5
    for seen in script.seen:
        assert seen.headers["Idempotency-Key"] == "order-1:3:0"
        assert seen.headers["Flowlock-Fencing-Token"] == "41"
        assert seen.headers["Authorization"] == "Bearer t"
        assert seen.headers["Content-Type"] == "application/json"
        assert seen.body == {
            "key": "order-1:3:0",
            "kind": "notify",
            "instance_id": "order-1",
            "version": 3,
            "payload": {"to": "ann"},
            "attempt": 2,
            "fencing_token": 41,
        }


async def test_408_and_other_4xx(server: tuple[str, Script]) -> None:
    """408 is retried like 429; 404 and 422 are refused; no fencing header without a token."""
    url, script = server
    script.answers.extend([(408, {}, ""), (404, {}, ""), (422, {}, "")])
    hook = flowlock.outbox.webhook(url)
    message = _message(fencing_token=None)
    try:
        with pytest.raises(flowlock.DeliveryFailed) as timed_out:
            await hook(message)
        assert not isinstance(timed_out.value, flowlock.DeliveryRefused)
        for _ in range(2):
            with pytest.raises(flowlock.DeliveryRefused):
                await hook(message)
    finally:
        await hook.aclose()
    assert all("Flowlock-Fencing-Token" not in s.headers for s in script.seen)
    assert all(s.body["fencing_token"] is None for s in script.seen)


async def test_through_the_engine_retried_then_done(server: tuple[str, Script]) -> None:
    """Registered with on_emit: 500, 429 and a hang are retried (the 429's Retry-After is
    waited, up to the backoff's cap), then 200 is done; one key throughout."""
    url, script = server
    script.answers.extend([(500, {}, ""), (429, {"Retry-After": "30"}, ""), HANG, (200, {}, "")])
    hook = flowlock.outbox.webhook(url, timeout=0.3)
    async with flowlock.connect("memory://", outbox_backoff=FAST) as engine:
        await engine.register(noter())
        engine.on_emit("k", hook, timeout=2.0)
        await noted(engine, "n1")
        done = await status_is(engine, "n1:2:0", "done")
        assert hook._clients  # one client, kept open between deliveries
    assert not hook._clients  # closed with the engine
    assert done.attempts == 4
    assert [s.body["attempt"] for s in script.seen] == [1, 2, 3, 4]
    assert {s.headers["Idempotency-Key"] for s in script.seen} == {"n1:2:0"}
    # The 429 asked for 30 s; the dispatcher waited its cap (1 s) rather than a few ms.
    assert script.seen[2].at - script.seen[1].at >= 0.9


async def test_through_the_engine_a_400_is_dead_at_once(server: tuple[str, Script]) -> None:
    """A 400 ends the message dead after one attempt, its answer in last_error."""
    url, script = server
    script.answers.append((400, {}, "bad payload"))
    async with flowlock.connect("memory://", outbox_backoff=FAST) as engine:
        await engine.register(noter())
        engine.on_emit("k", flowlock.outbox.webhook(url))
        await noted(engine, "n1")
        dead = await status_is(engine, "n1:2:0", "dead")
    assert dead.attempts == 1
    assert "400: bad payload" in (dead.last_error or "")
    assert len(script.seen) == 1


async def test_then_turns_the_answer_into_the_next_event(server: tuple[str, Script]) -> None:
    """`then(message, response)` may return a Then, fired under the message key."""
    url, script = server
    script.answers.append((200, {"Content-Type": "application/json"}, '{"charge": "ch_1"}'))

    def charged(message: flowlock.Message, response: httpx.Response) -> flowlock.Then:
        return flowlock.Then("charged", {"charge": response.json()["charge"]})

    async with flowlock.connect("memory://") as engine:
        await engine.register(shop())
        engine.on_emit("charge", flowlock.outbox.webhook(url, then=charged))
        await engine.create("shop", instance_id="o1")
        await engine.fire("o1", "reserve")
        await status_is(engine, "o1:2:0", "done")
        [_, entry] = await engine.history("o1")
    assert (entry.event, entry.request_id, dict(entry.payload)) == (
        "charged",
        "o1:2:0",
        {"charge": "ch_1"},
    )


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("ftp://example.invalid/x",), {}),
        (("no scheme",), {}),
        ((42,), {}),
        (("http://127.0.0.1/x",), {"headers": {"X": 1}}),
        (("http://127.0.0.1/x",), {"headers": ["X"]}),
        (("http://127.0.0.1/x",), {"timeout": 0}),
        (("http://127.0.0.1/x",), {"then": "no"}),
    ],
)
def test_bad_webhook_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A bad URL, headers, timeout or then is InvalidInput when the handler is made."""
    with pytest.raises(flowlock.InvalidInput):
        flowlock.outbox.webhook(*args, **kwargs)


def test_retry_after_in_seconds_or_as_a_date() -> None:
    """Retry-After is a number of seconds or an HTTP date; anything else is ignored."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert retry_after("120") == 120.0
    assert retry_after(" 3 ") == 3.0
    assert retry_after(format_datetime(now + timedelta(seconds=90), usegmt=True), now) == 90.0
    assert retry_after(format_datetime(now - timedelta(seconds=90), usegmt=True), now) == 0.0
    assert retry_after("soon") is None
    assert retry_after("-5") is None
    assert retry_after(None) is None


def test_without_httpx_the_webhook_names_its_extra() -> None:
    """flowlock.outbox imports no httpx; webhook() without it raises ExtraNotInstalled naming
    the `webhook` extra."""
    probe = (
        "import sys\n"
        "sys.modules['httpx'] = None\n"
        "import flowlock, flowlock.outbox\n"
        "assert 'httpx' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
        "try:\n"
        "    flowlock.outbox.webhook('http://127.0.0.1/x')\n"
        "except flowlock.ExtraNotInstalled as exc:\n"
        "    print(exc.extra, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("webhook "), done.stdout
    assert "flowlock.outbox.webhook" in done.stdout


async def test_the_log_handler_logs_and_is_done(caplog: pytest.LogCaptureFixture) -> None:
    """flowlock.outbox.log logs each message at INFO and marks it done."""
    caplog.set_level(logging.INFO, logger="flowlock.outbox")
    async with flowlock.connect("memory://") as engine:
        await engine.register(noter())
        engine.on_emit("k", flowlock.outbox.log)
        await noted(engine, "n1")
        await status_is(engine, "n1:2:0", "done")
    assert any("n1:2:0" in r.getMessage() and '{"i": 0}' in r.getMessage() for r in caplog.records)
