"""The start gate of the multi-process tests (proc_worker.Gate) fails a run whose processes did
not overlap, and passes one whose processes did: the overlap it reports is evidence."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from proc_worker import Gate, Phase

HERE = Path(__file__).parent

# argv: gate directory, this worker's number, workers in all, how it runs, the tests' directory.
# "on-time" starts its phase at the go signal; "late" only once every other worker has recorded
# the end of its own. "together" and "slow" wait at all_started at the start of their phase;
# "slow" starts it after more than the others' work, as a process the machine scheduled late.
WORKER = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[5])
    from proc_worker import all_started, ready_and_wait, record_phase

    async def main(gate, proc, workers, how):
        await ready_and_wait(gate, proc)
        if how == "late":
            others = [Path(gate, f"phase-{p}.json") for p in range(workers) if p != proc]
            while not all(p.exists() for p in others):
                await asyncio.sleep(0.01)
        if how == "slow":
            await asyncio.sleep(0.5)  # descheduled for longer than the others' work
        start = time.monotonic()
        if how in ("together", "slow"):
            await all_started(gate, proc)
        await asyncio.sleep(0.2)  # the "work" of the phase
        record_phase(gate, proc, start, time.monotonic())

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    """
)


async def _run(gate: Gate, late: set[int], how: str = "on-time", odd: str = "late") -> None:
    procs = []
    for p in range(gate.processes):
        how_p = odd if p in late else how
        args = [str(gate), str(p), str(gate.processes), how_p, str(HERE)]
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", WORKER, *args, stderr=subprocess.PIPE
            )
        )
    try:
        await gate.open_when_ready(procs)
        for proc in procs:
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_processes_started_together_overlap(tmp_path: Path) -> None:
    """Three processes released by one go signal: their phases overlap and the gate says so."""
    gate = Gate(tmp_path, 3)
    await _run(gate, late=set())
    phases = gate.assert_overlapped()
    assert sorted(p.proc for p in phases) == [0, 1, 2]


async def test_a_process_that_runs_after_the_others_fails_the_check(tmp_path: Path) -> None:
    """A process whose phase starts after the others' ended makes assert_overlapped fail."""
    gate = Gate(tmp_path, 3)
    await _run(gate, late={2})
    with pytest.raises(AssertionError, match="did not overlap"):
        gate.assert_overlapped()


async def test_a_worker_scheduled_late_still_overlaps_behind_all_started(
    tmp_path: Path,
) -> None:
    """A worker that starts its phase after the others' work would have ended (as a process a
    loaded machine schedules late) still overlaps them when every worker waits at all_started:
    none begins its work before all are in their phase."""
    gate = Gate(tmp_path, 3)
    await _run(gate, late={2}, how="together", odd="slow")
    phases = gate.assert_overlapped()
    slow = next(p for p in phases if p.proc == 2)
    assert all(p.end > slow.start for p in phases)


async def test_a_worker_that_dies_before_ready_fails_at_once(tmp_path: Path) -> None:
    """A worker that exits before saying ready fails the gate with its stderr, no go given."""
    gate = Gate(tmp_path, 2)
    dead = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; sys.exit('broken worker')", stderr=subprocess.PIPE
    )
    await dead.wait()
    with pytest.raises(AssertionError, match="broken worker"):
        await gate.open_when_ready([dead])
    assert not (tmp_path / "go").exists()


def test_phases_compare_on_one_clock(tmp_path: Path) -> None:
    """The check is max(starts) < min(ends): touching phases overlap only if they truly do."""
    gate = Gate(tmp_path, 2)
    for phase in (Phase(0, 10.0, 11.0), Phase(1, 10.5, 12.0)):
        (tmp_path / f"phase-{phase.proc}.json").write_text(json.dumps(phase._asdict()))
    gate.assert_overlapped()
    (tmp_path / "phase-1.json").write_text(json.dumps(Phase(1, 11.0, 12.0)._asdict()))
    with pytest.raises(AssertionError, match="did not overlap"):
        gate.assert_overlapped()
