"""One concern per module: no source module of flowlock or its lab is over 600 lines."""

from __future__ import annotations

from pathlib import Path

import flowlock

SRC = Path(flowlock.__file__).resolve().parent
LAB = SRC.parents[1] / "lab" / "src"
MOST = 600


def test_no_source_module_is_over_600_lines() -> None:
    """A module that grows past 600 lines is split by concern (see CONTRIBUTING)."""
    roots = [SRC, *([LAB] if LAB.is_dir() else [])]
    sizes = {
        str(path.relative_to(root.parent)): len(path.read_text(encoding="utf-8").splitlines())
        for root in roots
        for path in root.rglob("*.py")
    }
    assert sizes, roots
    assert {name: n for name, n in sizes.items() if n > MOST} == {}
