"""tests/django's project served by real Django servers (`manage.py runserver`'s command, threaded,
two processes on one database) and driven over HTTP: a view's own row and its transition commit
together or not at all, concurrent requests on one instance apply one decision, and the admin's
fire action, logged in through the login form, applies once when its form is sent twice."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dj_kit
import httpx
import pytest

from flowlock.checker import check

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _runserver(schema: str, log_dir: Path) -> Iterator[str]:
    """The project under `django-admin runserver` (threaded) on a free port; its base URL."""
    port = _free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "djsettings",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "FLOWLOCK_DJANGO_SCHEMA": schema,
        "FLOWLOCK_TEST_DATABASE_URL": dj_kit.url(),
    }
    log = open(log_dir / f"server-{port}.log", "w+b")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/admin/login/", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"the Django server did not start: {log.read().decode()[-3000:]}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.fixture(scope="module")
def servers(django_project: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two Django server processes on the same project and database; their base URLs."""
    log_dir = tmp_path_factory.mktemp("django")
    with _runserver(django_project, log_dir) as one, _runserver(django_project, log_dir) as two:
        yield [one, two]


@pytest.fixture
def server(servers: list[str]) -> str:
    return servers[0]


def _seen(iid: str) -> tuple[str | None, int, int]:
    with dj_kit.other_connection() as conn:
        row = conn.execute("SELECT state FROM flowlock_instances WHERE id = %s", (iid,)).fetchone()
        history = conn.execute(
            "SELECT count(*) FROM flowlock_history WHERE instance_id = %s", (iid,)
        ).fetchone()
        orders = conn.execute(
            "SELECT count(*) FROM djapp_order WHERE instance_id = %s", (iid,)
        ).fetchone()
    assert history is not None and orders is not None
    return (row[0] if row else None), history[0], orders[0]


def test_a_view_commits_its_row_and_the_transition_together(server: str) -> None:
    from flowlock.contrib.django import engine

    kept, undone = f"web-{uuid.uuid4().hex[:8]}", f"web-{uuid.uuid4().hex[:8]}"
    for iid in (kept, undone):
        engine().create("approval", instance_id=iid)
    ok = httpx.post(f"{server}/orders/{kept}/approve", data={"note": "by http"}, timeout=10)
    assert ok.status_code == 200, ok.text
    assert ok.json() == {"applied": True, "state": "approved", "version": 2}
    assert _seen(kept) == ("approved", 1, 1)
    failed = httpx.post(f"{server}/orders/{undone}/approve?fail=1", timeout=10)
    assert failed.status_code == 500
    assert _seen(undone) == ("pending", 0, 0)
    # A transition refused inside the block: the view answers 409, its own row is not kept.
    refused = httpx.post(f"{server}/orders/missing-{kept}/approve", timeout=10)
    assert refused.status_code == 409 and refused.json()["error"] == "InstanceNotFound"
    assert _seen(f"missing-{kept}") == (None, 0, 0)


def test_concurrent_requests_on_two_servers_apply_one_decision(servers: list[str]) -> None:
    from flowlock.contrib.django import engine

    iid = f"webrace-{uuid.uuid4().hex[:8]}"
    engine().create("approval", instance_id=iid)

    def post(i: int) -> httpx.Response:
        return client.post(f"{servers[i % 2]}/orders/{iid}/approve")

    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(post, range(24)))
    codes = sorted(a.status_code for a in answers)
    applied = [a for a in answers if a.status_code == 200 and a.json()["applied"]]
    assert len(applied) == 1, [a.text for a in answers]
    assert set(codes) <= {200, 409}
    # Every 200 kept its order row (the winner's, and the idempotent answers'); a 409 none.
    assert _seen(iid) == ("approved", 1, codes.count(200))
    verdict = check(engine().get(iid), engine().history(iid), initial_state="pending",
                    expected_applied=1)  # fmt: skip
    assert verdict.ok, verdict.violations


def _csrf(client: httpx.Client, html: str) -> str:
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


def test_the_admin_over_http_fires_once_for_a_form_sent_twice(server: str) -> None:
    from flowlock.contrib.django import engine

    iid = f"webadm-{uuid.uuid4().hex[:8]}"
    engine().create("approval", instance_id=iid)
    changelist = f"{server}/admin/flowlock/instance/"
    with httpx.Client(timeout=10, follow_redirects=True) as client:
        login = client.get(f"{server}/admin/login/")
        page = client.post(
            f"{server}/admin/login/?next=/admin/flowlock/instance/",
            data={"username": dj_kit.USER, "password": dj_kit.PASSWORD,
                  "csrfmiddlewaretoken": _csrf(client, login.text),
                  "next": "/admin/flowlock/instance/"},
        )  # fmt: skip
        assert page.status_code == 200 and "Select instance to view" in page.text, page.text[:300]
        listed = client.get(changelist, params={"q": iid})
        assert iid in listed.text
        form = client.post(
            changelist,
            data={"action": "fire_event", "_selected_action": iid, "index": "0",
                  "csrfmiddlewaretoken": _csrf(client, listed.text)},
        )  # fmt: skip
        rid = re.search(r'name="request_id" value="([^"]+)"', form.text)
        assert rid is not None, form.text[:500]
        fields = {"action": "fire_event", "_selected_action": iid, "apply": "yes",
                  "event": "approve", "payload": "{}", "request_id": rid.group(1),
                  "csrfmiddlewaretoken": _csrf(client, form.text)}  # fmt: skip
        first = client.post(changelist, data=fields)
        second = client.post(changelist, data=fields)
    assert "1 applied" in first.text
    assert "0 applied" in second.text and "1 already done" in second.text
    [entry] = engine().history(iid)
    assert (entry.event, entry.actor) == ("approve", dj_kit.USER)
