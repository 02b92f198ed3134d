"""Access through a real `flowlock serve`: tokens with scopes read from FLOWLOCK_API_TOKEN reach
the worker with their scope, and the loopback rule (no token: loopback only, unless --insecure).

Each server runs on the memory store (one worker, about 2 s to start); the refusals are
processes that exit at once.
"""

from __future__ import annotations

import httpx
import pytest
from serve_harness import Services, free_port, run_serve

from flowlock.core.errors import InvalidInput
from flowlock.service.server import Listen, check, is_loopback
from flowlock.service.settings import ServiceSettings, parse_tokens

READ = "reader-secret-0123456789abcdef"
WRITE = "writer-secret-0123456789abcdef"
ADMIN = "admin-secret-0123456789abcdefg"
TOKENS = f"ann:{READ}:read,bot:{WRITE}:write,ops:{ADMIN}:admin"


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_scopes_through_a_served_process() -> None:
    """Tokens from the environment, the service on all addresses (allowed: tokens are set):
    the probes answer anyone; a read needs a token; read cannot create; write creates and fires
    as its principal and cannot reach /admin/; admin gets past the guard there; /metrics needs
    a token."""
    with Services() as services:
        served = services.start(
            "--database-url", "memory://", "--host", "0.0.0.0", env={"FLOWLOCK_API_TOKEN": TOKENS}
        )
        with httpx.Client(base_url=served.url, timeout=10.0) as client:
            assert client.get("/readyz").status_code == 200
            assert client.get("/instances").status_code == 401
            assert client.get("/metrics").status_code == 401
            assert client.get("/instances", headers=bearer(READ)).status_code == 200
            body = {"workflow": "approval", "id": "p1"}
            refused = client.post("/instances", json=body, headers=bearer(READ))
            assert refused.status_code == 403, refused.text
            assert refused.json()["needed"] == "write" and refused.json()["scope"] == "read"
            created = client.post("/instances", json=body, headers=bearer(WRITE))
            assert created.status_code == 201, created.text
            fired = client.post("/instances/p1/events/approve", headers=bearer(WRITE))
            assert fired.status_code == 200, fired.text
            history = client.get("/instances/p1/history", headers=bearer(READ)).json()
            assert [e["actor"] for e in history["items"]] == ["bot"]
            # The write token was read back by the worker as write (not widened to admin, not
            # narrowed to read): /admin/ refuses it, and lets the admin token by.
            admin = client.post("/admin/workflows/approval/pause", json={"reason": "r"},
                                headers=bearer(WRITE))  # fmt: skip
            assert admin.status_code == 403 and admin.json()["needed"] == "admin", admin.text
            admitted = client.get("/admin/workflows/pauses", headers=bearer(ADMIN))
            assert admitted.status_code not in (401, 403), admitted.text
            assert client.get("/metrics", headers=bearer(READ)).status_code == 200


def test_without_tokens_a_foreign_host_header_is_refused() -> None:
    """DNS rebinding through a real server: without tokens, on loopback, a request whose Host
    is another name gets 403 untrusted-host (the console too, and no session cookie); the
    same request to 127.0.0.1 is answered. (--insecure answers any host: tested below, on the
    server test_insecure_listens_anywhere_without_a_token starts anyway.)"""
    with Services() as services:
        served = services.start("--database-url", "memory://")
        with httpx.Client(base_url=served.url, timeout=10.0) as client:
            assert client.get("/instances").status_code == 200
            for path in ("/instances", "/ui/", "/admin/workflows/pauses"):
                got = client.get(path, headers={"Host": "rebound.attacker.example"})
                assert got.status_code == 403, (path, got.text)
                assert got.json()["type"].endswith(":untrusted-host"), got.text
                assert "set-cookie" not in got.headers
            assert client.get("/ui/", headers={"Host": "localhost"}).status_code == 200


def test_open_metrics_from_the_environment() -> None:
    """FLOWLOCK_OPEN_METRICS=true: /metrics without a token; the instances still need one."""
    with Services() as services:
        served = services.start(
            "--database-url",
            "memory://",
            env={"FLOWLOCK_API_TOKEN": TOKENS, "FLOWLOCK_OPEN_METRICS": "true"},
        )
        with httpx.Client(base_url=served.url, timeout=10.0) as client:
            assert client.get("/metrics").status_code == 200
            assert client.get("/instances").status_code == 401


# One host through a process in the quick suite; the rest are slow (a process start each):
# test_loopback_addresses classifies every one of them in-process.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", pytest.param("::", marks=_SLOW), pytest.param("192.0.2.10", marks=_SLOW),
     pytest.param("example.com", marks=_SLOW)],
)  # fmt: skip
def test_no_token_and_no_loopback_is_refused(host: str) -> None:
    """Without a token, a --host that is not loopback: exit 1, one line saying what to do, and
    no server started."""
    done = run_serve("--database-url", "memory://", "--port", str(free_port()), "--host", host)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: --host {host} is not a loopback address"), lines[0]
    assert "FLOWLOCK_API_TOKEN" in lines[0] and "--insecure" in lines[0]
    assert "Uvicorn running" not in done.stdout + done.stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_insecure_listens_anywhere_without_a_token(how: str) -> None:
    """--insecure (or FLOWLOCK_INSECURE=true) lifts the rule: the service starts on 0.0.0.0
    and answers without a token, whatever the Host header names."""
    args = ["--database-url", "memory://", "--host", "0.0.0.0"]
    env = {}
    if how == "flag":
        args.append("--insecure")
    else:
        env["FLOWLOCK_INSECURE"] = "true"
    with Services() as services:
        served = services.start(*args, env=env)
        with httpx.Client(base_url=served.url, timeout=10.0) as client:
            assert client.get("/instances").status_code == 200
            got = client.get("/instances", headers={"Host": "flowlock.internal"})
            assert got.status_code == 200, got.text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("128.0.0.1", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    """What counts as loopback, and check() with it: refused only without tokens and
    without insecure."""
    assert is_loopback(host) is loopback
    bare = ServiceSettings()
    tokened = ServiceSettings(api_tokens=parse_tokens(TOKENS))
    check(tokened, Listen(host=host))
    check(bare, Listen(host=host, insecure=True))
    if loopback:
        check(bare, Listen(host=host))
    else:
        with pytest.raises(InvalidInput, match="not a loopback address"):
            check(bare, Listen(host=host))
