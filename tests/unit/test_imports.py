"""What importing flowlock loads, checked in a fresh interpreter each time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import flowlock
from flowlock.core.errors import ExtraNotInstalled
from flowlock.core.extras import require
from flowlock.core.install import pip_install

# The drivers and the web stack: what a SQLite user must never load.
HEAVY = ("asyncpg", "redis", "fastapi", "uvicorn", "starlette", "prometheus_client")


def _loaded_after(code: str) -> set[str]:
    """The top-level packages of HEAVY that ``code`` loads in a fresh interpreter."""
    probe = (
        f"import sys, json\n{code}\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import flowlock",
        "import flowlock.sync",
        "import flowlock.engine",
        "import flowlock.locks, flowlock.stores, flowlock.checker",
        "import flowlock.http",
        "import flowlock; flowlock.Engine; flowlock.Workflow; flowlock.connect; flowlock.sync",
        "import flowlock; flowlock.Adaptive; flowlock.ConflictMonitor; flowlock.Store",
    ],
)
def test_the_core_loads_no_driver_and_no_web_stack(code: str) -> None:
    """import flowlock, flowlock.sync and flowlock.engine load none of the heavy extras."""
    assert _loaded_after(code) == set()


def test_a_sqlite_engine_loads_no_driver() -> None:
    """A whole SQLite workflow runs without loading asyncpg, redis or the web stack."""
    code = (
        "import asyncio, tempfile, flowlock\n"
        "async def main(d):\n"
        "    async with flowlock.connect(f'sqlite:///{d}/x.db') as engine:\n"
        "        await engine.register(flowlock.examples.approval())\n"
        "        await engine.create('approval', instance_id='r')\n"
        "        assert (await engine.fire('r', 'approve')).applied\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    asyncio.run(main(d))"
    )
    assert _loaded_after(code) == set()


@pytest.mark.parametrize(
    ("code", "extra"),
    [
        ("flowlock.connect('postgresql://u@localhost/db')", "postgres"),
        ("flowlock.connect('sqlite:///x.db', redis_url='redis://localhost')", "redis"),
        ("flowlock.Metrics()", "metrics"),
        ("import flowlock.service", "service"),
    ],
)
def test_a_missing_extra_is_one_clear_error(code: str, extra: str) -> None:
    """Without the extra's driver, the feature raises ExtraNotInstalled naming the pip line."""
    hide = ["asyncpg", "redis", "prometheus_client", "fastapi", "uvicorn"]
    probe = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in hide)
        + "import flowlock\n"
        + "try:\n"
        + f"    {code}\n"
        + "except flowlock.ExtraNotInstalled as exc:\n"
        + "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.endswith(f": {pip_install(extra)}")
    assert "\n" not in message


def test_require_names_the_extra_and_is_an_import_error() -> None:
    """require() raises ExtraNotInstalled, which is both a FlowlockError and an ImportError."""
    with pytest.raises(ExtraNotInstalled) as info:
        require("flowlock_no_such_module", "postgres", "a test feature")
    assert isinstance(info.value, ImportError) and isinstance(info.value, flowlock.FlowlockError)
    assert info.value.extra == "postgres" and info.value.feature == "a test feature"
    assert str(info.value).endswith(f": {pip_install('postgres')}")
