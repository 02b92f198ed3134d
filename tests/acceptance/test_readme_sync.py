"""The README's "Django and Flask (sync API)" section stays true: the Flask example runs as
written (on SQLite, with Flask's test client, from many threads), and the Django example is
valid Python that uses the names flowlock exports."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import flowlock

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(heading: str) -> list[str]:
    """The python blocks under ``heading``, up to the next heading of any level (a ``#`` line
    inside a code block is a comment, not a heading)."""
    lines = README.splitlines(keepends=True)
    start = lines.index(heading + "\n") + 1
    fenced, end = False, len(lines)
    for i in range(start, len(lines)):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", lines[i]):
            end = i
            break
    return re.findall(r"```python\n(.*?)```", "".join(lines[start:end]), re.S)


def test_the_flask_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Flask example as written: a first approve applies (200), its retry with the same
    Idempotency-Key and a second administrator's approve answer 200 idempotent, 16 threads at
    once on another request apply it once, an unknown id is a 404, and the error mapping gives
    each error class its status."""
    (code,) = blocks("### Flask")
    path = tmp_path / "readme_flask_app.py"
    path.write_text(code, encoding="utf-8")
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'app.db'}")
    spec = importlib.util.spec_from_file_location("readme_flask_app", path)
    assert spec is not None and spec.loader is not None
    app = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "readme_flask_app", app)
    spec.loader.exec_module(app)
    try:
        app.engine.create("approval", instance_id="req-1")
        app.engine.create("approval", instance_id="req-2")
        client = app.app.test_client()
        headers = {"X-User": "alice", "Idempotency-Key": "k-1"}
        first = client.post("/approvals/req-1/approve", headers=headers)
        again = client.post("/approvals/req-1/approve", headers=headers)
        bob = client.post("/approvals/req-1/approve", headers={"X-User": "bob"})
        assert (first.status_code, first.json) == (200, {"state": "approved", "applied": True})
        assert (again.status_code, again.json) == (200, {"state": "approved", "applied": False})
        assert (bob.status_code, bob.json) == (200, {"state": "approved", "applied": False})
        missing = client.post("/approvals/nope/approve")
        assert missing.status_code == 404 and missing.json["error"] == "InstanceNotFound"

        barrier = threading.Barrier(16, timeout=60)

        def admin(n: int) -> tuple[int, bool]:
            barrier.wait()
            answer = app.app.test_client().post(
                "/approvals/req-2/approve", headers={"X-User": f"admin-{n}"}
            )
            return answer.status_code, answer.json["applied"]

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(admin, range(16)))
        assert sorted(answers) == [(200, False)] * 15 + [(200, True)]
        assert len(app.engine.history("req-2")) == 1

        status = app.http_status
        assert status(flowlock.InstanceNotFound("x")) == 404
        assert status(flowlock.PayloadTooLarge(10, 2)) == 400
        assert status(flowlock.TransitionNotAllowed("x", "e", "s", (), 2)) == 409
        assert status(flowlock.GuardRejected("no")) == 409
        assert status(flowlock.VersionMismatch("x", 1, 2, "s")) == 409
        assert status(flowlock.ConflictRetriesExhausted("x", "e", 3)) == 503
        assert status(flowlock.LockTimeout("k", 1.0)) == 503
        assert status(flowlock.StoreBusy(1.0, 20)) == 503
        assert status(flowlock.StoreError("boom")) == 500
    finally:
        app.engine.close()
    assert app.engine.closed


def test_the_django_example_is_valid_python() -> None:
    """Each block of the Django example parses, and the app config builds the engine with
    flowlock.sync.Engine.connect in ready() and registers a workflow there."""
    codes = blocks("### Django")
    assert len(codes) == 3
    trees = [ast.parse(code) for code in codes]
    apps = ast.unparse(trees[1])
    assert "def ready(self) -> None:" in apps
    assert "flowlock.sync.Engine.connect(settings.FLOWLOCK_DATABASE_URL" in apps
    assert "engine.register(" in apps
    views = ast.unparse(trees[2])
    assert "except flowlock.FlowlockError as exc:" in views
    assert "status=http_status(exc)" in views
