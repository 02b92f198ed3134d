"""The embedded servers' process toolkit on its own: commands run within a bound, child processes
started, found in /proc and stopped, log tails."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from flowlock.embedded import process


def test_log_tail_is_the_last_lines_or_nothing(tmp_path: Path) -> None:
    """The last lines of a log; "" for a log not written yet."""
    log = tmp_path / "server.log"
    assert process.log_tail(log) == ""
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert process.log_tail(log, 2) == "line 98\nline 99"


def test_run_reports_status_and_output(tmp_path: Path) -> None:
    """A command that finishes: its status and its stdout and stderr together."""
    done = process.run(
        [sys.executable, "-c", "import sys; print('out'); sys.exit('err')"],
        cwd=tmp_path,
        timeout=30,
    )
    assert done.returncode == 1
    assert not done.ok
    assert done.output.split() == ["out", "err"]


def test_run_past_its_bound_has_no_status(tmp_path: Path) -> None:
    """A command still running at its bound is killed and reported with status None."""
    done = process.run(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"],
        cwd=tmp_path,
        timeout=0.5,
    )
    assert done.returncode is None
    assert done.output.strip() == "started"


def test_free_port_can_be_bound() -> None:
    """The port returned is free on the loopback address."""
    with socket.socket() as sock:
        sock.bind((process.HOST, process.free_port()))


def test_a_process_tree_is_found_and_stopped(tmp_path: Path) -> None:
    """A child and its grandchild are found from the child's pid and stopped by one signal to
    the leader, escalating to SIGKILL for the grandchild that ignores it."""
    code = (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    leader = process.spawn([sys.executable, "-c", code], cwd=tmp_path)
    try:
        tree: set[int] = set()
        for _ in range(200):
            tree = process.process_tree({leader.pid})
            if len(tree) == 2:
                break
            time.sleep(0.01)
        assert leader.pid in tree
        assert len(tree) == 2
        left = process.stop_tree(tree, leaders={leader.pid}, first=signal.SIGTERM, timeout=0.5)
        assert left == set()
        leader.wait(5)
        assert not any(process.alive(pid) for pid in tree)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def test_wait_ready_is_false_when_the_process_exits(tmp_path: Path) -> None:
    """Waiting for readiness ends at once when the process exits, however far the deadline."""
    proc = process.spawn([sys.executable, "-c", "pass"], cwd=tmp_path)
    assert not process.wait_ready(proc, lambda: False, deadline=float("inf"))
    assert proc.returncode == 0


@pytest.mark.parametrize("answer", [True, False])
def test_wait_ready_asks_until_the_deadline(tmp_path: Path, answer: bool) -> None:
    """A running process: True as soon as it answers, False at the deadline if it never does."""
    proc = process.spawn([sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path)
    try:
        assert process.wait_ready(proc, lambda: answer, time.monotonic() + 0.2) is answer
    finally:
        process.terminate(proc, 5)
    assert proc.returncode is not None
