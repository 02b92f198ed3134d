"""The `FLOWLOCK` setting, read and checked, and the project's one engine built from it.

```python
FLOWLOCK = {
    "DATABASE": "default",          # a DATABASES alias: its PostgreSQL, read by the admin too
    # "DATABASE_URL": "postgresql://...",  # or a URL of its own (the admin reads DATABASE)
    "WORKFLOWS": "orders.workflows",  # dotted paths: a Workflow, a list of them, or a module
    "OPTIONS": {"schema": "flowlock"},  # flowlock.sync.Engine.connect's keywords
}
```
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from flowlock.core.definition import Workflow
from flowlock.sync import Engine

__all__ = ["Config", "close_engine", "config", "project_engine"]

_KEYS = frozenset({"DATABASE", "DATABASE_URL", "WORKFLOWS", "OPTIONS"})


@dataclass(frozen=True)
class Config:
    """The `FLOWLOCK` setting, checked: the database alias the admin reads (and, without a URL
    of its own, the engine writes to), the engine's URL, workflow paths and connect keywords."""

    alias: str
    url: str
    workflows: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def schema(self) -> str | None:
        found = self.options.get("schema")
        return found if isinstance(found, str) else None


def config() -> Config:
    """The `FLOWLOCK` setting, checked. ImproperlyConfigured says what is wrong."""
    raw = getattr(settings, "FLOWLOCK", None)
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(
            "flowlock.contrib.django needs a FLOWLOCK setting, a dict such as "
            '{"DATABASE": "default", "WORKFLOWS": "myapp.workflows"} (see the Django guide)'
        )
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ImproperlyConfigured(f"FLOWLOCK has unknown keys {unknown}; it takes {sorted(_KEYS)}")
    alias = raw.get("DATABASE", "default")
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        raise ImproperlyConfigured(
            f"FLOWLOCK['DATABASE'] is {alias!r}, not an alias of DATABASES "
            f"({sorted(settings.DATABASES)})"
        )
    url = raw.get("DATABASE_URL") or url_of(settings.DATABASES[alias], alias)
    if not isinstance(url, str):
        raise ImproperlyConfigured("FLOWLOCK['DATABASE_URL'] must be a postgresql:// URL")
    paths = raw.get("WORKFLOWS", ())
    workflows = (paths,) if isinstance(paths, str) else tuple(paths)
    if not all(isinstance(p, str) for p in workflows):
        raise ImproperlyConfigured("FLOWLOCK['WORKFLOWS'] takes a dotted path or a list of them")
    options = raw.get("OPTIONS", {})
    if not isinstance(options, Mapping):
        raise ImproperlyConfigured("FLOWLOCK['OPTIONS'] must be a dict of Engine.connect keywords")
    return Config(alias, url, workflows, dict(options))


def url_of(database: Mapping[str, Any], alias: str) -> str:
    """A postgresql:// URL for a DATABASES entry (Django's PostgreSQL backend only)."""
    engine = str(database.get("ENGINE", ""))
    if "postgresql" not in engine:
        raise ImproperlyConfigured(
            f"FLOWLOCK['DATABASE'] is {alias!r}, whose ENGINE is {engine!r}; flowlock's Django "
            "app runs on PostgreSQL (django.db.backends.postgresql). Give FLOWLOCK a "
            "DATABASE_URL of its own, or point DATABASE at a PostgreSQL alias"
        )
    user = quote(str(database.get("USER") or ""), safe="")
    password = quote(str(database.get("PASSWORD") or ""), safe="")
    host = str(database.get("HOST") or "")
    port = str(database.get("PORT") or "")
    name = quote(str(database.get("NAME") or ""), safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    if host.startswith("/"):  # a Unix socket directory
        return f"postgresql://{auth}/{name}?host={quote(host, safe='')}" + (
            f"&port={port}" if port else ""
        )
    where = host or "localhost"
    return f"postgresql://{auth}{where}{':' + port if port else ''}/{name}"


def workflows_at(path: str) -> list[Workflow]:
    """The workflows a dotted path names: a Workflow, an iterable of them, a callable returning
    either, or a module (its Workflow attributes)."""
    module_name, _, attr = path.rpartition(".")
    try:
        found: Any = importlib.import_module(path)
    except ImportError:
        if not module_name:
            raise ImproperlyConfigured(f"FLOWLOCK['WORKFLOWS']: cannot import {path!r}") from None
        try:
            found = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ImproperlyConfigured(
                f"FLOWLOCK['WORKFLOWS']: cannot import {path!r} ({exc})"
            ) from exc
    if isinstance(found, ModuleType):
        return [v for v in vars(found).values() if isinstance(v, Workflow)]
    if callable(found) and not isinstance(found, Workflow):
        found = found()
    if isinstance(found, Workflow):
        return [found]
    if isinstance(found, Iterable) and all(isinstance(w, Workflow) for w in found):
        return list(found)
    raise ImproperlyConfigured(
        f"FLOWLOCK['WORKFLOWS']: {path!r} is not a Workflow, a list of them, or a module"
    )


_lock = threading.Lock()
_engine: Engine | None = None


def project_engine() -> Engine:
    """The engine of the `FLOWLOCK` setting, built (not connected) on the first call."""
    global _engine
    with _lock:
        if _engine is None or _engine.closed:
            conf = config()
            built = Engine.connect(conf.url, **conf.options)
            for path in conf.workflows:
                for workflow in workflows_at(path):
                    built.register(workflow)
            _engine = built
        return _engine


def close_engine() -> None:
    global _engine
    with _lock:
        built, _engine = _engine, None
    if built is not None:
        built.close()
