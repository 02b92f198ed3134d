"""DNS rebinding: a service without tokens answers only requests addressed to a loopback host.

Without tokens the only wall is that the caller is on the machine. A web page whose name an
attacker resolves to 127.0.0.1 reaches that port from the victim's browser, but its requests
carry the attacker's name as their Host: the guard refuses them (403 `untrusted-host`),
everywhere, the console (which hands an open admin session) and /admin/ included, before
anything is read or written. Through the ASGI app with httpx, the Host header set per request.
"""

from __future__ import annotations

import pytest

from flowlock.service import ServiceSettings
from flowlock.service.guard import loopback_host
from flowlock.service.settings import parse_tokens
from service.kit import assert_problem, served

ADMIN = "ops-secret-0123456789abcdef"

FOREIGN = [
    "attacker.example",
    "attacker.example:8000",
    "127.0.0.1.nip.io",
    "localhost.attacker.example",
    "0.0.0.0",
    "[::2]:8000",
    "10.0.0.1",
    "127.0.0.1:80x",
    "[::1]x",
    "",
]
LOOPBACK = [
    "localhost",
    "LOCALHOST:8000",
    "localhost.",
    "127.0.0.1",
    "127.0.0.1:8000",
    "127.1.2.3:1",
    "[::1]",
    "[::1]:8000",
    "::1",
]
PATHS = [
    ("GET", "/instances"),
    ("GET", "/livez"),
    ("GET", "/ui/"),
    ("GET", "/admin/workflows/pauses"),
    ("POST", "/admin/workflows/approval/pause"),
    ("POST", "/instances"),
]


@pytest.mark.parametrize("host", FOREIGN + LOOPBACK)
def test_loopback_host(host: str) -> None:
    assert loopback_host(host) is (host in LOOPBACK)


async def test_a_foreign_host_is_refused_everywhere_and_nothing_is_written() -> None:
    async with served() as svc:
        await svc.engine.create("approval", instance_id="a1")
        for host in FOREIGN[:4]:
            for method, path in PATHS:
                body = {"workflow": "approval", "id": "evil"} if path == "/instances" else None
                if path.endswith("/pause"):
                    body = {"reason": "rebinding"}
                got = await svc.client.request(method, path, json=body, headers={"Host": host})
                found = assert_problem(got, 403, "untrusted-host")
                assert "loopback" in found["detail"] and "FLOWLOCK_API_TOKEN" in found["detail"]
                assert "set-cookie" not in got.headers  # no console session handed out
        assert [i.id for i in (await svc.engine.list()).instances] == ["a1"]
        assert await svc.engine.workflow_pauses() == []
        assert not (await svc.engine.get("a1")).paused


async def test_a_loopback_host_is_answered() -> None:
    async with served() as svc:
        for host in LOOPBACK:
            got = await svc.client.get("/instances", headers={"Host": host})
            assert got.status_code == 200, (host, got.text)
        page = await svc.client.get("/ui/", headers={"Host": "localhost:8000"})
        assert page.status_code == 200, page.text


async def test_insecure_answers_any_host() -> None:
    """Behind a proxy that decides who reaches the service (--insecure)."""
    async with served(ServiceSettings(insecure=True)) as svc:
        got = await svc.client.get("/instances", headers={"Host": "flowlock.internal"})
        assert got.status_code == 200, got.text


async def test_with_tokens_the_token_decides_not_the_host() -> None:
    tokens = parse_tokens(f"ops:{ADMIN}:admin")
    async with served(ServiceSettings(api_tokens=tokens)) as svc:
        host = {"Host": "flowlock.example.com"}
        assert (await svc.client.get("/instances", headers=host)).status_code == 401
        auth = {**host, "Authorization": f"Bearer {ADMIN}"}
        assert (await svc.client.get("/instances", headers=auth)).status_code == 200


def test_insecure_from_the_environment() -> None:
    """FLOWLOCK_INSECURE reaches each worker's settings (flowlock serve passes it on)."""
    settings = ServiceSettings.from_env({"FLOWLOCK_INSECURE": "true"})
    assert settings.insecure
    assert settings.to_env()["FLOWLOCK_INSECURE"] == "true"
    assert not ServiceSettings.from_env({}).insecure
