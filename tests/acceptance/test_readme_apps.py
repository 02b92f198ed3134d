"""The README's Flask and Django examples, run as written: each is written into a project from
the README's blocks, served by gunicorn with threads, and called over HTTP. Flask runs on
PostgreSQL and on SQLite, Django (a `startproject` project, its users logged in at the admin,
CSRF on) on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from doc_blocks import ROOT
from readme_apps import (
    Api,
    DjangoApi,
    FlaskApi,
    Server,
    django_project,
    environment,
    flask_project,
    serve,
    timed_post,
)

import flowlock
import pg_budget
from flowlock.checker import CallRecord, check_linearizable, check_many

pytestmark = pytest.mark.slow

README = (ROOT / "README.md").read_text(encoding="utf-8")
PASSWORDS = {"alice": "alice-pw-1234", "bob": "bob-pw-1234", "carol": "carol-pw-1234"}
PROBLEM_JSON = "application/problem+json"


@dataclass
class App:
    """An example being served: how to call it, and where it keeps its instances."""

    kind: str
    api: Api
    server: Server
    database_url: str
    schema: str | None

    def engine(self) -> flowlock.sync.Engine:
        """A second engine on the app's database, for reading back what the app wrote."""
        return flowlock.sync.Engine.connect(self.database_url, schema=self.schema)


@pytest.fixture(scope="module", params=["flask-postgres", "flask-sqlite", "django-postgres"])
def app(
    request: pytest.FixtureRequest, pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[App]:
    """One README example, written into a project of its own and served by gunicorn."""
    kind: str = request.param
    project = tmp_path_factory.mktemp(kind)
    with ExitStack() as stack:
        if kind.endswith("sqlite"):
            database_url = f"sqlite:///{project / 'flowlock.db'}"
        else:
            database_url = stack.enter_context(pg_budget.fresh_database(pg_url, "readme"))
        env = environment(FLOWLOCK_DATABASE_URL=database_url)
        if kind.startswith("flask"):
            flask_project(project)
            server = stack.enter_context(serve(project, "app:app", env))
            yield App(kind, FlaskApi(server.url), server, database_url, None)
        else:
            django_project(project, env, PASSWORDS)
            server = stack.enter_context(serve(project, "mysite.wsgi", env))
            yield App(kind, DjangoApi(server.url, PASSWORDS), server, database_url, "flowlock")


def _problem(answer: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    """The answer is an RFC 9457 problem of `status` and type `slug`, with nothing in it that
    a client should not see; its body."""
    assert answer.status_code == status, (answer.status_code, answer.text)
    assert answer.headers["content-type"] == PROBLEM_JSON
    body: dict[str, Any] = answer.json()
    assert body["type"] == f"urn:flowlock:problem:{slug}", body
    assert body["status"] == status and body["instance"] == answer.request.url.path
    for secret in ("postgresql", "sqlite", "127.0.0.1", "Traceback", "engine."):
        assert secret not in answer.text, answer.text
    return body


def test_the_example_creates_fires_and_answers_as_the_service_does(app: App) -> None:
    """A create and its retry (same Idempotency-Key) make one instance; an approve and its
    retry apply once, a second administrator's approve is idempotent; a taken id is 409, a bad
    body 422, a key reused for another create or event 422, a refused event 409, an unknown
    instance or event 404, all as problems; an anonymous user is refused before anything is
    read."""
    api = app.api
    with api.client("carol") as carol, api.client("alice") as alice, api.client("bob") as bob:
        created = api.create(carol, {"id": "req-1", "amount": 120}, key="c-1")
        assert created.status_code == 201, created.text
        assert created.json() == {"id": "req-1", "state": "pending", "version": 1}
        again = api.create(carol, {"id": "req-1", "amount": 120}, key="c-1")
        assert (again.status_code, again.json()) == (201, created.json())

        taken = _problem(api.create(carol, {"id": "req-1", "amount": 5}), 409, "instance-exists")
        assert taken["instance_id"] == "req-1"
        _problem(api.create(carol, {"amount": 5}), 422, "invalid-input")
        other = api.create(carol, {"id": "req-2", "amount": 120}, key="c-1")
        assert _problem(other, 422, "idempotency-key-reused")["original_instance_id"] == "req-1"

        first = api.fire(alice, "req-1", "approve", key="a-1", payload={"comment": "fine"})
        assert first.status_code == 200, first.text
        assert first.json() == {
            "id": "req-1", "state": "approved", "version": 2, "applied": True,
            "idempotent": False,
        }  # fmt: skip
        retry = api.fire(alice, "req-1", "approve", key="a-1", payload={"comment": "fine"})
        assert (retry.status_code, retry.json()["applied"], retry.json()["idempotent"]) == (
            200, False, True,
        )  # fmt: skip
        second = api.fire(bob, "req-1", "approve")
        assert (second.status_code, second.json()["applied"], second.json()["idempotent"]) == (
            200, False, True,
        )  # fmt: skip

        reused = _problem(api.fire(alice, "req-1", "reject", key="a-1"), 422,
                          "idempotency-key-reused")  # fmt: skip
        assert reused["original_event"] == "approve"
        refused = _problem(api.fire(bob, "req-1", "reject"), 409, "transition-not-allowed")
        assert (refused["state"], refused["allowed"]) == ("approved", [])
        _problem(api.fire(alice, "req-404", "approve"), 404, "instance-not-found")
        unknown = _problem(api.fire(alice, "req-1", "escalate"), 404, "unknown-event")
        assert unknown["known"] == ["approve", "reject"]

    with api.client(None) as anonymous:
        assert api.create(anonymous, {"id": "req-anon"}).status_code == 401
        assert api.fire(anonymous, "req-1", "reject").status_code == 401

    with app.engine() as engine:
        instance = engine.get("req-1")
        assert (instance.state, instance.version) == ("approved", 2)
        assert instance.data == {"amount": 120, "requested_by": "carol"}
        [entry] = engine.history("req-1")
        assert (entry.event, entry.actor, entry.request_id) == ("approve", "alice", "a-1")
        assert entry.payload == {"comment": "fine"}
        with pytest.raises(flowlock.InstanceNotFound):
            engine.get("req-anon")
    assert "Error handling request" not in app.server.log, app.server.log


def test_a_storm_of_administrators_applies_each_event_once(app: App) -> None:
    """48 requests from 48 threads at once on four approvals, half of them sent twice under
    one Idempotency-Key, approving or rejecting: per approval one applies, the same event is
    idempotent, the other is a 409; the callers' answers are linearizable and the stored
    histories exactly-once."""
    api = app.api
    ids = [f"storm-{n}" for n in range(4)]
    rng = random.Random(7)
    with api.client("alice") as alice, api.client("bob") as bob:
        records: list[CallRecord] = []
        for iid in ids:
            began, answer, ended = timed_post(api.create, alice, {"id": iid}, key=iid)
            assert answer.status_code == 201, answer.text
            records.append(_record(iid, "create", None, began, answer, ended))
        calls = [
            (iid, rng.choice(["approve", "reject"]), f"{iid}-k{n}", alice if n % 2 else bob)
            for iid in ids
            for n in range(6)
        ]
        calls = [call for call in calls for _ in range(2)]  # each key sent twice
        rng.shuffle(calls)
        barrier = threading.Barrier(len(calls), timeout=60)

        def send(call: tuple[str, str, str, httpx.Client]) -> CallRecord:
            iid, event, key, client = call
            barrier.wait()
            began, answer, ended = timed_post(api.fire, client, iid, event, key)
            return _record(iid, "fire", event, began, answer, ended)

        with ThreadPoolExecutor(len(calls)) as pool:
            records += pool.map(send, calls)
    fired = [r for r in records if r.op == "fire"]
    assert {r.outcome for r in fired} <= {"ok", "fail"}, [r.error for r in fired]
    applied = {
        iid: sum(r.instance_id == iid and r.outcome == "ok" and not r.idempotent for r in fired)
        for iid in ids
    }
    assert applied == dict.fromkeys(ids, 1), applied
    verdict = check_linearizable(records, flowlock.examples.approval())
    assert verdict.ok, verdict.describe()
    with app.engine() as engine:
        stored = [(engine.get(iid), engine.history(iid)) for iid in ids]
    checked = check_many(stored, initial_state="pending", expected_applied=applied)
    assert checked.ok, checked.violations


def _record(
    iid: str,
    op: str,
    event: str | None,
    began: float,
    answer: httpx.Response,
    ended: float,
) -> CallRecord:
    """A call as its caller saw it. The approval workflow has no effect, so every answer
    carries the data its create stored (the answers do not repeat it)."""
    if answer.status_code in (200, 201):
        body = answer.json()
        return CallRecord(
            iid, op, event, began, ended, "ok",
            state=body["state"], version=body["version"],
            data={"amount": None, "requested_by": "alice"},
            idempotent=bool(body.get("idempotent")) and not body.get("applied"),
            workflow="approval",
        )  # fmt: skip
    assert answer.status_code == 409, answer.text  # refused: nothing written
    return CallRecord(iid, op, event, began, ended, "fail", error=answer.json()["type"])


async def test_a_held_row_lock_is_a_503_with_retry_after_and_the_same_key_then_applies(
    app: App,
) -> None:
    """While another transaction holds the instance's row lock, an approve waits the store's
    lock_timeout (5 s) and is answered 503 lock-timeout with Retry-After, the full error in the
    server's log; sent again with the same Idempotency-Key after the lock is gone, it applies,
    once."""
    if app.database_url.startswith("sqlite"):
        pytest.skip("a row lock held by another session is PostgreSQL's")
    api = app.api
    with api.client("alice") as alice:
        assert api.create(alice, {"id": "req-lock"}).status_code == 201
        table = "flowlock_instances" if app.schema is None else f'"{app.schema}".flowlock_instances'
        conn = await pg_budget.connect(app.database_url)
        try:
            async with conn.transaction():
                await conn.execute(f"SELECT 1 FROM {table} WHERE id = $1 FOR UPDATE", "req-lock")
                began = asyncio.get_running_loop().time()
                busy = await asyncio.to_thread(api.fire, alice, "req-lock", "approve", "l-1")
                waited = asyncio.get_running_loop().time() - began
        finally:
            await conn.close()
        body = _problem(busy, 503, "lock-timeout")
        assert busy.headers["retry-after"] == "1"
        assert body["key"] is not None
        assert 4 < waited < 30, waited
        retried = api.fire(alice, "req-lock", "approve", key="l-1")
        assert retried.status_code == 200, retried.text
        assert retried.json()["applied"] is True
    assert "answered 503" in app.server.log
    async with flowlock.Engine.connect(app.database_url, schema=app.schema) as engine:
        assert [h.request_id for h in await engine.history("req-lock")] == ["l-1"]


def test_django_refuses_a_post_without_its_csrf_token(app: App) -> None:
    """The Django example keeps Django's CSRF protection: a logged-in user's POST without the
    X-CSRFToken header is a 403, and nothing is created."""
    if not app.kind.startswith("django"):
        pytest.skip("the Flask example takes JSON bodies only instead of a CSRF token")
    api = app.api
    with api.client("alice") as alice:
        del alice.headers["X-CSRFToken"]
        assert api.create(alice, {"id": "req-csrf"}).status_code == 403
    with app.engine() as engine, pytest.raises(flowlock.InstanceNotFound):
        engine.get("req-csrf")


def test_flask_refuses_a_body_that_is_not_json(app: App) -> None:
    """The Flask example takes JSON bodies only (what a cross-site form cannot send): a form
    POST is a 415, and nothing is created."""
    if not app.kind.startswith("flask"):
        pytest.skip("the Django example checks a CSRF token instead")
    with app.api.client("alice") as alice:
        answer = alice.post("/approvals", data={"id": "req-form"})
        assert answer.status_code == 415
    with app.engine() as engine, pytest.raises(flowlock.InstanceNotFound):
        engine.get("req-form")


def test_the_flask_sections_curl_session_answers_as_it_says(app: App) -> None:
    """The Flask section's curl commands, run by bash against the served example (on an id of
    their own): the create is 201, and of the two administrators approving at once one
    applied and the other was answered idempotent."""
    if not app.kind.startswith("flask") or shutil.which("curl") is None:
        pytest.skip("the curl session is the Flask section's (and needs curl)")
    section = README.split("\n### Flask\n", 1)[1].split("\n### ", 1)[0]
    (script,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    host = app.server.url.removeprefix("http://")
    script = script.replace("localhost:8000", host).replace("req-1", "req-curl")
    done = subprocess.run(
        ["bash", "-c", script.replace("c-1", "c-curl") + "wait\n"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # curl prints each JSON body as it came (Flask ends them with a newline).
    created, *approvals = [json.loads(line) for line in done.stdout.splitlines() if line]
    assert created == {"id": "req-curl", "state": "pending", "version": 1}
    answers = sorted((a["applied"], a["idempotent"]) for a in approvals)
    assert answers == [(False, True), (True, False)], done.stdout
