"""A fresh venv with only the base install: the core runs, every extra is named when missing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import tomllib
import uuid
import venv
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

import flowlock
import pg_budget

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
    # Installed from the checkout: the command installs the extra from it.
    assert done.stdout.strip().endswith(f": pip install '{ROOT}[{extra}]'"), done.stdout
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
        assert f"pip install '{ROOT}[{extra}]'" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


# The README's "Install" section, and the hint of an error, followed on the base install. It
# changes the venv (an extra, then flowlock from a wheel), so it runs after the tests above.


def _install_commands() -> list[str]:
    """The command lines of the README's "Install" section, in order."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _shell(command: str, venv_bin: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`command` in bash, with the venv's `pip` and `python` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FLOWLOCK_"))}
    env["PATH"] = f"{venv_bin}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=600, env=env
    )


def _hint(python: Path, code: str) -> str:
    """The pip command that ExtraNotInstalled names for `code`, run on `python`."""
    probe = (
        f"import flowlock\ntry:\n    {code}\n"
        "except flowlock.ExtraNotInstalled as exc:\n    print(exc)\n"
    )
    done = _run(python, "-c", probe)
    assert done.returncode == 0, done.stderr
    command = done.stdout.strip().rpartition(": ")[2]
    assert command.startswith("pip install "), done.stdout
    return command


@contextlib.contextmanager
def _fresh_database(pg_url: str) -> Iterator[str]:
    name = f"install_{uuid.uuid4().hex[:12]}"
    asyncio.run(_execute(pg_url, f'CREATE DATABASE "{name}"'))
    try:
        yield urlunsplit(urlsplit(pg_url)._replace(path=f"/{name}"))
    finally:
        asyncio.run(_execute(pg_url, f'DROP DATABASE "{name}" WITH (FORCE)'))


async def _execute(url: str, statement: str) -> None:
    conn = await pg_budget.connect(url)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def test_the_hints_and_the_readme_install_commands_work(
    base_venv: Path, tmp_path: Path, pg_url: str
) -> None:
    """The postgres hint's command is the README's install line for a checkout; run as printed,
    it adds asyncpg and a workflow then runs on PostgreSQL. The README's wheel commands build a
    wheel of the version in pyproject and install it with [postgres,redis]; that flowlock's
    metrics hint names the wheel, and its command adds the extra."""
    venv_bin = base_venv.parent
    commands = _install_commands()
    command = _hint(base_venv, "flowlock.connect('postgresql://app@localhost/app')")
    assert command == f"pip install '{ROOT}[postgres]'"
    readme_line = commands[1].replace("/path/to/flowlock", str(ROOT))
    assert readme_line == f".venv/bin/{command}", commands
    done = _shell(command, venv_bin, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    on_postgres = SQLITE_WORKFLOW.replace('f"sqlite:///{path}"', "path")
    with _fresh_database(pg_url) as database_url:
        done = _run(base_venv, "-c", on_postgres, database_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "applied 1"

    # A checkout of its own (the README's /path/to/flowlock), so the build writes nothing here.
    checkout = tmp_path / "flowlock"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(
        ".git", ".venv", "dist", "site", "*cache*", "__pycache__", "tests", "lab"
    ))  # fmt: skip
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel_lines = [c for c in commands if "wheel" in c or ".whl" in c]
    assert len(wheel_lines) == 2, commands
    assert f"flowlock-{version}-py3-none-any.whl[postgres,redis]" in wheel_lines[1]
    assert _run(base_venv, "-m", "pip", "uninstall", "-y", "flowlock").returncode == 0
    for line in wheel_lines:  # python3 -m pip wheel ...; .venv/bin/pip install '...whl[...]'
        line = line.replace("/path/to/flowlock", str(checkout))
        line = line.replace(".venv/bin/pip", str(venv_bin / "pip"))
        line = line.replace("python3 ", f"{base_venv} ")
        done = _shell(line, venv_bin, tmp_path)
        assert done.returncode == 0, (line, done.stderr[-3000:])
    wheel = checkout / "dist" / f"flowlock-{version}-py3-none-any.whl"
    assert wheel.is_file()
    listed = _run(base_venv, "-m", "pip", "list", "--format=freeze").stdout.lower()
    assert {"asyncpg", "redis"} <= {line.split("==")[0] for line in listed.splitlines()}

    command = _hint(base_venv, "flowlock.Metrics()")
    assert command == f"pip install '{wheel}[metrics]'"
    done = _shell(command, venv_bin, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _run(base_venv, "-c", "import flowlock; print(type(flowlock.Metrics()).__name__)")
    assert (done.returncode, done.stdout.strip()) == (0, "Metrics"), done.stderr


CONSOLE_FILES = """
import pathlib, flowlock
console = pathlib.Path(flowlock.__file__).parent / "service" / "console"
for folder in ("templates", "static"):
    print(folder, " ".join(sorted(p.name for p in (console / folder).iterdir())))
"""


def test_the_console_templates_and_static_files_ship_in_the_package(base_venv: Path) -> None:
    """The console's pages are package data: an installed (not editable) flowlock has them."""
    done = _run(base_venv, "-c", CONSOLE_FILES)
    assert done.returncode == 0, done.stderr
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert {"base.html", "login.html", "instance.html", "confirm.html"} <= set(
        found["templates"].split()
    )
    assert set(found["static"].split()) == {"console.css", "htmx.min.js", "htmx.LICENSE"}
