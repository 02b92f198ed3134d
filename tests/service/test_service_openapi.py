"""docs/openapi.json is the live app's OpenAPI document, to the byte: an API change without the
regenerated document (or the reverse) fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flowlock.service import create_app
from flowlock.service.openapi import document

COMMITTED = Path(__file__).parents[2] / "docs" / "openapi.json"
REGENERATE = (
    "docs/openapi.json differs from the live app's OpenAPI document; if the change is meant, "
    "regenerate it with `python -m flowlock.service.openapi > docs/openapi.json` and commit it "
    "(a release that bumps the version does this too: the document names it)"
)


def test_the_committed_document_is_the_live_one() -> None:
    """The committed file equals the document create_app() serves, as text and as JSON."""
    committed = COMMITTED.read_text(encoding="utf-8")
    assert json.loads(committed) == create_app().openapi(), REGENERATE
    assert committed == document(), REGENERATE


def test_the_document_is_stable_text() -> None:
    """Pretty-printed with sorted keys and a final newline, so an API change is a readable
    diff; the app serves the same document at /openapi.json."""
    text = document()
    assert text.endswith("}\n")
    schema = json.loads(text)
    assert text == json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    assert schema["openapi"].startswith("3.")
    assert set(schema["paths"]) == {
        "/admin/bulk",
        "/definitions",
        "/definitions/{workflow}",
        "/definitions/{workflow}/diagram",
        "/instances",
        "/instances/{instance_id}",
        "/instances/{instance_id}/events/{event}",
        "/instances/{instance_id}/history",
        "/instances/{instance_id}/messages",
        "/instances/{instance_id}/timers",
        "/livez",
        "/readyz",
        "/metrics",
        "/admin/instances/{instance_id}/force",
        "/admin/instances/{instance_id}/pause",
        "/admin/instances/{instance_id}/resume",
        "/admin/workflows/{workflow}/pause",
        "/admin/workflows/{workflow}/resume",
        "/admin/workflows/pauses",
        "/capacity/{kind}/{key}",
    }


def test_the_module_prints_the_document() -> None:
    """`python -m flowlock.service.openapi` prints exactly the document, as UTF-8 in any
    locale (how it is regenerated)."""
    src = str(Path(__file__).parents[2] / "src")
    printed = subprocess.run(
        [sys.executable, "-m", "flowlock.service.openapi"],
        capture_output=True,
        check=True,
        env={**os.environ, "PYTHONPATH": src, "LC_ALL": "C"},
        timeout=60,
    )
    assert printed.stdout.decode("utf-8") == document()
