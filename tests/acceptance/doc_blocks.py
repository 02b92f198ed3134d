"""The fenced python blocks of the README and of docs/, as the tests that run them read them.

Three kinds (CONTRIBUTING, "Code in the docs"):

- a block whose first line names a file (`# approvals/views.py`) is a file of an example
  application; `tests/acceptance/test_readme_apps.py` writes those files into a project and
  serves it. `# mysite/settings.py: add these lines at the end` appends to the file instead.
- a block right after an `<!-- fragment -->` line is a fragment on purpose: only compiled.
- every other block is run by `tests/acceptance/test_doc_blocks.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = "<!-- fragment -->"
APPEND = ": add these lines at the end"
_FILE = re.compile(r"# (?P<path>[\w/]+\.py)(?P<how>: .*)?")
_HEADING = re.compile(r"#{1,6} ")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and what kind it is."""

    source: str
    line: int
    section: str
    code: str
    fragment: bool

    @property
    def id(self) -> str:
        """`README.md:55`: the file and the line of the opening fence."""
        return f"{self.source}:{self.line}"

    @property
    def file(self) -> str | None:
        """The file of an example application this block is, or None."""
        found = _FILE.fullmatch(self.code.partition("\n")[0])
        return found["path"] if found else None

    @property
    def appends(self) -> bool:
        """Whether the block is added at the end of its file rather than being all of it."""
        found = _FILE.fullmatch(self.code.partition("\n")[0])
        if found is None or found["how"] is None:
            return False
        assert found["how"] == APPEND, f"{self.id}: unknown file marker {found['how']!r}"
        return True


def blocks(path: Path) -> list[Block]:
    """The python blocks of the Markdown file `path`, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    section, start = "", 0
    fence: str | None = None
    body: list[str] = []
    for n, line in enumerate(lines, 1):
        if fence is None:
            if line.startswith("```"):
                fence, start, body = line[3:].strip(), n, []
            elif _HEADING.match(line):
                section = line
            continue
        if line.startswith("```"):
            if fence == "python":
                before = next((s for s in reversed(lines[: start - 1]) if s.strip()), "")
                code = "\n".join(body) + "\n"
                source = str(path.relative_to(ROOT))
                found.append(Block(source, start, section, code, before.strip() == FRAGMENT))
            fence = None
        else:
            body.append(line)
    return found


def documents() -> list[Path]:
    """The README and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def every_block() -> list[Block]:
    """Every python block of the README and of docs/."""
    return [block for path in documents() for block in blocks(path)]


def app_files(section: str) -> list[Block]:
    """The README's file blocks under the heading `section` (`### Flask`), in order."""
    found = [b for b in blocks(ROOT / "README.md") if b.section == section and b.file]
    assert found, f"the README has no file blocks under {section!r}"
    return found
