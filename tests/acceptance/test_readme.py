"""The README stays true: its example runs, its two commands are the ones CI runs, CI runs every
check it names, and docs/promises.toml maps each of its promises to tests that exist."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_example_runs_and_runs_again(tmp_path: Path) -> None:
    """The first python block of the README runs as written, prints the refusal, and runs again
    in the same directory (it leaves nothing behind that a second run trips over)."""
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    for _ in range(2):
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
    assert list(tmp_path.iterdir()) == []


def test_readme_starts_with_the_two_commands() -> None:
    """Exactly two bash commands before the Install section: bench on the embedded default,
    then the tests."""
    head = README.split("\n## Install\n")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", head, re.S)
    assert len(commands) == 2
    assert commands[0].endswith("flowlock bench")
    assert "[test]" in commands[1] and commands[1].endswith("pytest")


@pytest.mark.parametrize("path", [".ci/run"])
def test_ci_runs_the_readme_test_command(path: str) -> None:
    """CI runs the README's test command verbatim."""
    head = README.split("\n## Install\n")[0]
    test_command = re.findall(r"```bash\n(.*?)\n```", head, re.S)[1]
    assert test_command in (ROOT / path).read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") + len(heading) + 1
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start)
    return text[start : end.start() if end else len(text)]


def _defined_tests(path: Path) -> set[str]:
    """The test functions ``path`` defines, as ``name`` or ``Class::name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef):
            found |= {
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return {name for name in found if name.rpartition("::")[2].startswith("test_")}


@pytest.mark.slow
def test_every_promise_names_tests_that_exist() -> None:
    """docs/promises.toml, the README's promises (the docs site's table): every entry names at
    least one test, every test it names exists (file and function), and every metric the
    README lists has an entry."""
    source = (ROOT / "docs" / "promises.toml").read_text(encoding="utf-8")
    rows = tomllib.loads(source)["promise"]
    assert len(rows) >= 40, len(rows)
    missing: list[str] = []
    for row in rows:
        refs = [re.fullmatch(r"(tests/[\w/]+\.py)::([\w:]+)", test) for test in row["tests"]]
        assert refs, f"no test named for: {row['text']}"
        assert all(refs), row["tests"]
        for ref in refs:
            assert ref is not None
            path = ROOT / ref[1]
            if not path.is_file() or ref[2] not in _defined_tests(path):
                missing.append(ref[0])
    assert not missing, missing
    promises = " ".join(row["text"] for row in rows)
    metrics = set(re.findall(r"`(flowlock_\w+)", _section(README, "### Observability")))
    assert len(metrics) == 10, metrics
    assert not {m for m in metrics if f"`{m}`" not in promises}


def test_ci_runs_every_check_the_readme_names() -> None:
    """The checks the README's Development section names (ruff check, ruff format --check,
    mypy, lint-imports, mkdocs build --strict, a coverage floor) are each run by .ci/run; the
    floor is pyproject's, which .ci/run's coverage run reads."""
    development = _section(README, "## Development")
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8")
    checks = {
        "`ruff check`": ".venv/bin/ruff check src tests",
        "`ruff format --check`": ".venv/bin/ruff format --check src tests",
        "`mypy`": ".venv/bin/mypy",
        "`lint-imports`": ".venv/bin/lint-imports",
        "`mkdocs build --strict`": ".venv/bin/mkdocs build --strict",
        "coverage floor": "--cov=flowlock",
    }
    for named, command in checks.items():
        assert named in development, named
        assert command in ci, command
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["tool"]["coverage"]["report"]["fail_under"] >= 89


def test_the_repository_is_self_contained() -> None:
    """The README, the docs, the changelog and every string in the package (the bench's output
    and ``--help`` included) stand on their own: none points at design notes, seed files or a
    folder outside the repository that a user does not have."""
    outside = re.compile(
        r"\.\./shared|DESIGN\.md|NOTES\.md|STYLE\.md|\bseed/|design notes", re.IGNORECASE
    )
    texts = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
    texts += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "src").rglob("*.py"))
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in texts
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if outside.search(line)
    ]
    assert found == []
