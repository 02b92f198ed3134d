"""MkDocs hooks: the promise table and the changelog, with their links made site-relative.

The promises live in docs/promises.toml; the acceptance tests read the same file.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "docs" / "promises.toml"


def table() -> str:
    """The promises as one Markdown table: the promise, then the tests that hold it."""
    promises = tomllib.loads(SOURCE.read_text(encoding="utf-8"))["promise"]
    lines = ["| README promise | held by |", "|---|---|"]
    for promise in promises:
        tests = "<br>".join(f"`{test}`" for test in promise["tests"])
        lines.append(f"| {promise['text']} | {tests} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill in the promise table; point root-relative links at the pages here.

    The changelog and the promises are written to be read from the repository root, where
    a guide is docs/x.md. On the site that page is x.md.
    """
    if page.file.src_uri == "promises.md":
        markdown = markdown.replace("<!-- promises -->", table())
    elif page.file.src_uri == "changelog.md":
        markdown = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    else:
        return markdown
    return re.sub(r"\]\(docs/", "](", markdown)
