"""A fresh venv with only the base install: the core runs, every extra is named when missing."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

import flowlock

ROOT = Path(flowlock.__file__).resolve().parents[2]
HEAVY = ("asyncpg", "redis", "fastapi", "uvicorn", "prometheus-client", "uvloop")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree"),
]

SQLITE_WORKFLOW = """
import asyncio, sys, flowlock

async def main(path):
    async with flowlock.connect(f"sqlite:///{path}") as engine:
        await engine.register(flowlock.examples.approval())
        await engine.create("approval", instance_id="req-1")
        alice, bob = await asyncio.gather(
            engine.fire("req-1", "approve", actor="alice"),
            engine.fire("req-1", "approve", actor="bob"),
        )
        assert alice.applied != bob.applied
        print("applied", len(await engine.history("req-1")))

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with ``pip install <checkout>``: no extras."""
    home = tmp_path_factory.mktemp("base-venv")
    venv.create(home, with_pip=True)
    python = home / "bin" / "python"
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def _run(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FLOWLOCK_"))}
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_base_install_has_no_driver_and_no_web_stack(base_venv: Path) -> None:
    """pip install flowlock brings neither database drivers nor a web server."""
    listed = _run(base_venv, "-m", "pip", "list", "--format=freeze").stdout.lower()
    installed = {line.split("==")[0] for line in listed.splitlines()}
    assert "flowlock" in installed
    assert not installed & set(HEAVY), installed & set(HEAVY)


def test_a_sqlite_workflow_runs_on_the_base_install(base_venv: Path, tmp_path: Path) -> None:
    """Two admins approve at once on SQLite: one applied, one idempotent, one history row."""
    done = _run(base_venv, "-c", SQLITE_WORKFLOW, str(tmp_path / "x.db"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "applied 1"


def test_the_sync_api_runs_on_the_base_install(base_venv: Path, tmp_path: Path) -> None:
    """flowlock.sync.Engine works on SQLite with the base install."""
    code = (
        "import sys, flowlock\n"
        "with flowlock.sync.Engine.connect(f'sqlite:///{sys.argv[1]}') as engine:\n"
        "    engine.register(flowlock.examples.approval())\n"
        "    engine.create('approval', instance_id='r')\n"
        "    print(engine.fire('r', 'approve').instance.state)\n"
    )
    done = _run(base_venv, "-c", code, str(tmp_path / "s.db"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "approved"


@pytest.mark.parametrize(
    ("code", "extra"),
    [
        ("flowlock.connect('postgresql://app@localhost/app')", "postgres"),
        ("flowlock.connect('sqlite:///x.db', redis_url='redis://localhost:6379/0')", "redis"),
        ("flowlock.Metrics()", "metrics"),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(base_venv: Path, code: str, extra: str) -> None:
    """The feature raises ExtraNotInstalled whose one-line message is the pip install line."""
    probe = (
        "import flowlock\n"
        f"try:\n    {code}\n"
        "except flowlock.ExtraNotInstalled as exc:\n    print(exc)\n"
    )
    done = _run(base_venv, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert f"pip install 'flowlock[{extra}]'" in done.stdout
    assert len(done.stdout.strip().splitlines()) == 1


def test_the_cli_core_commands_run_and_the_others_name_their_extra(
    base_venv: Path, tmp_path: Path
) -> None:
    """flowlock --help and the inspection commands run on SQLite; serve and bench name the
    extra they need in one error line, without a traceback."""
    flowlock_cmd = base_venv.parent / "flowlock"
    done = subprocess.run([flowlock_cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    db = tmp_path / "cli.db"
    _run(base_venv, "-c", SQLITE_WORKFLOW, str(db))
    shown = subprocess.run(
        [flowlock_cmd, "show", "req-1", "--database-url", f"sqlite:///{db}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "approved" in shown.stdout
    for command, extra in (("serve", "service"), ("bench", "bench")):
        done = subprocess.run([flowlock_cmd, command], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"flowlock[{extra}]" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
