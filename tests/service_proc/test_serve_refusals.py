"""``flowlock serve`` refuses what cannot work before it serves anything: at once, with a
non-zero status and one line that says what to do, never a traceback. Each case is one short
process (about 1 s, mostly imports) that exits on its own: no server is left to stop."""

from __future__ import annotations

import pytest
from serve_harness import free_port, run_serve

# Port 1 on the loopback: nothing listens there, so a connection is refused at once.
NO_SERVER = "postgresql://postgres@127.0.0.1:1/nothing"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            ["--database-url", "memory://", "--app", "no_such_module_here:flows"],
            "no module named 'no_such_module_here'",
            id="app-module-missing",
        ),
        pytest.param(
            ["--database-url", "memory://", "--app", "flowlock.examples:no_such_flow"],
            "has no attribute 'no_such_flow'",
            id="app-attribute-missing",
            marks=pytest.mark.slow,  # the same path as a missing module, for the quick suite
        ),
        pytest.param(
            ["--database-url", "memory://", "--app", "flowlock.examples"],
            "not a reference of the form",
            id="app-without-attribute",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--database-url", "memory://", "--workers", "2"],
            "memory keeps its data in one process",
            id="memory-with-two-workers",
        ),
        pytest.param(
            ["--database-url", NO_SERVER, "--workers", "2"],
            "cannot connect to PostgreSQL",
            id="unreachable-database-with-two-workers",
        ),
    ],
)
def test_refused_with_one_line(args: list[str], says: str) -> None:
    done = run_serve("--port", str(free_port()), *args)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert "Uvicorn running" not in done.stdout + done.stderr
