"""The pip command that adds an extra to the flowlock that is installed.

flowlock is installed from a checkout or from a wheel built from one, not from a registry, so
`pip install 'flowlock[postgres]'` would find nothing (or someone else's package). pip records
where a distribution came from in its `direct_url.json` (PEP 610): the hints name that place,
so the command they give installs the extra from the same checkout or wheel. A flowlock
installed from an index (a private one, say) has no such record, and the plain name is right.
"""

from __future__ import annotations

import json
import shlex
from importlib import metadata
from urllib.parse import unquote, urlsplit

__all__ = ["lab_install", "origin", "pip_install"]


def origin() -> tuple[str, bool] | None:
    """Where this flowlock was installed from, as pip names it, and whether it is editable.

    A local checkout or wheel is its path; another URL is `flowlock @ URL`. None when pip
    recorded no direct origin (an index), or flowlock is not installed at all (a bare source
    tree on `sys.path`)."""
    try:
        raw = metadata.distribution("flowlock").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not raw:
        return None
    try:
        found = json.loads(raw)
        url = str(found["url"])
    except (ValueError, KeyError, TypeError):
        return None
    editable = bool(found.get("dir_info", {}).get("editable", False))
    parts = urlsplit(url)
    if parts.scheme == "file" and "vcs_info" not in found:
        return unquote(parts.path), editable
    vcs = found.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs"):
        commit = vcs.get("commit_id")
        url = f"{vcs['vcs']}+{url}" + (f"@{commit}" if commit else "")
    return f"@ {url}", editable


def pip_install(extra: str) -> str:
    """The command that installs `extra` into this flowlock's environment, from where
    flowlock came: `pip install '/path/to/flowlock[postgres]'` for a checkout,
    `pip install -e '...'` for an editable one, the wheel's path for a wheel."""
    where = origin()
    if where is None:
        return f"pip install {shlex.quote(f'flowlock[{extra}]')}"
    path, editable = where
    if path.startswith("@ "):
        return f"pip install {shlex.quote(f'flowlock[{extra}] {path}')}"
    flag = "-e " if editable else ""
    return f"pip install {flag}{shlex.quote(f'{path}[{extra}]')}"


def lab_install() -> str:
    """The command that installs flowlock's lab (the `lab/` folder of a checkout)."""
    where = origin()
    if where is not None and not where[0].startswith("@ ") and not where[0].endswith(".whl"):
        return f"pip install -e {shlex.quote(where[0].rstrip('/') + '/lab')}"
    return "pip install -e ./lab, from a flowlock checkout"
