"""The README stays true: its example runs, and its two commands are the ones CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_example_runs(tmp_path: Path) -> None:
    """The first python block of the README runs as written and prints the refusal."""
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    done = subprocess.run(
        [sys.executable, "-c", code.group(1)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "approved ()"


def test_readme_starts_with_the_two_commands() -> None:
    """Exactly two bash commands before the example: bench on the embedded default, then tests."""
    head = README.split("## Example")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", head, re.S)
    assert len(commands) == 2
    assert commands[0].endswith("flowlock bench")
    assert "[test]" in commands[1] and commands[1].endswith("pytest")


@pytest.mark.parametrize("path", [".ci/run"])
def test_ci_runs_the_readme_test_command(path: str) -> None:
    """CI runs the README's test command verbatim."""
    head = README.split("## Example")[0]
    test_command = re.findall(r"```bash\n(.*?)\n```", head, re.S)[1]
    assert test_command in (ROOT / path).read_text(encoding="utf-8")
