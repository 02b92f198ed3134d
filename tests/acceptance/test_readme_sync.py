"""The README's Flask example runs as written in the quick suite: on SQLite, with Flask's test
client, from many threads. Both examples are served by gunicorn in test_readme_apps.py."""

from __future__ import annotations

import importlib.util
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from doc_blocks import app_files

from flowlock.checker import check
from flowlock.http import PROBLEM_JSON


def test_the_flask_example_runs_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Flask example's app.py as written, on SQLite with Flask's test client (the quick
    check; test_readme_apps.py serves it with gunicorn): a create and its retry make one
    approval, 16 administrators approving at once apply it once, and errors are problems."""
    (block,) = app_files("### Flask")
    path = tmp_path / "readme_flask_app.py"
    path.write_text(block.code, encoding="utf-8")
    monkeypatch.setenv("FLOWLOCK_DATABASE_URL", f"sqlite:///{tmp_path / 'app.db'}")
    spec = importlib.util.spec_from_file_location("readme_flask_app", path)
    assert spec is not None and spec.loader is not None
    app = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "readme_flask_app", app)
    spec.loader.exec_module(app)
    try:
        client = app.app.test_client()
        carol = {"X-User": "carol", "Idempotency-Key": "c-1"}
        created = client.post("/approvals", json={"id": "req-1", "amount": 120}, headers=carol)
        again = client.post("/approvals", json={"id": "req-1", "amount": 120}, headers=carol)
        assert (created.status_code, again.status_code) == (201, 201), created.text
        assert created.json == again.json == {"id": "req-1", "state": "pending", "version": 1}

        barrier = threading.Barrier(16, timeout=60)

        def admin(n: int) -> tuple[int, bool]:
            barrier.wait()
            answer = app.app.test_client().post(
                "/approvals/req-1/approve", json={}, headers={"X-User": f"admin-{n}"}
            )
            return answer.status_code, answer.json["applied"]

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(admin, range(16)))
        assert sorted(answers) == [(200, False)] * 15 + [(200, True)]
        history = app.engine.history("req-1")
        assert len(history) == 1
        assert check(app.engine.get("req-1"), history, initial_state="pending").ok

        refused = client.post("/approvals/req-1/reject", json={}, headers={"X-User": "bob"})
        assert (refused.status_code, refused.content_type) == (409, PROBLEM_JSON)
        assert refused.json["type"] == "urn:flowlock:problem:transition-not-allowed"
        missing = client.post("/approvals/nope/approve", json={}, headers={"X-User": "bob"})
        assert (missing.status_code, missing.json["instance"]) == (404, "/approvals/nope/approve")
        assert client.post("/approvals/req-1/approve", json={}).status_code == 401
    finally:
        app.engine.close()
    assert app.engine.closed
