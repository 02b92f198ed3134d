"""The install hints name a command that works where flowlock came from: its checkout, its
wheel, a URL, or an index."""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

import pytest

from flowlock.core import install
from flowlock.core.errors import ExtraNotInstalled
from flowlock.core.extras import require

NO_LAB = "pip install -e ./lab, from a flowlock checkout"


class _Dist:
    def __init__(self, direct_url: dict[str, Any] | None) -> None:
        self.raw = None if direct_url is None else json.dumps(direct_url)

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return self.raw


def _installed(monkeypatch: pytest.MonkeyPatch, direct_url: dict[str, Any] | None) -> None:
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(direct_url))


@pytest.mark.parametrize(
    ("direct_url", "command", "lab"),
    [
        (
            {"url": "file:///src/flowlock", "dir_info": {}},
            "pip install '/src/flowlock[postgres]'",
            "pip install -e /src/flowlock/lab",
        ),
        (
            {"url": "file:///src/my%20flowlock", "dir_info": {"editable": True}},
            "pip install -e '/src/my flowlock[postgres]'",
            "pip install -e '/src/my flowlock/lab'",
        ),
        (
            {"url": "file:///dist/flowlock-0.3.0-py3-none-any.whl", "archive_info": {}},
            "pip install '/dist/flowlock-0.3.0-py3-none-any.whl[postgres]'",
            NO_LAB,
        ),
        (
            {"url": "https://git.example/fl", "vcs_info": {"vcs": "git", "commit_id": "ab12"}},
            "pip install 'flowlock[postgres] @ git+https://git.example/fl@ab12'",
            NO_LAB,
        ),
        (None, "pip install 'flowlock[postgres]'", NO_LAB),
    ],
    ids=["checkout", "editable", "wheel", "vcs", "index"],
)
def test_the_hint_installs_from_where_flowlock_came(
    monkeypatch: pytest.MonkeyPatch, direct_url: dict[str, Any] | None, command: str, lab: str
) -> None:
    """pip's record of flowlock's origin (PEP 610) becomes the command's source; without one
    (an index), the plain name."""
    _installed(monkeypatch, direct_url)
    assert install.pip_install("postgres") == command
    assert install.lab_install() == lab
    with pytest.raises(ExtraNotInstalled) as raised:
        require("flowlock_no_such_module", "postgres", "a feature")
    assert str(raised.value) == (
        f"a feature needs flowlock_no_such_module, which is not installed: {command}"
    )


def test_no_distribution_or_a_broken_record_falls_back_to_the_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A source tree that was never installed, or a record that is not JSON, names the extra."""

    def missing(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert install.pip_install("redis") == "pip install 'flowlock[redis]'"
    broken = _Dist(None)
    broken.raw = "{not json"
    monkeypatch.setattr(metadata, "distribution", lambda name: broken)
    assert install.origin() is None
