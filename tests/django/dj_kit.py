"""tests/django's project, set up once per test run: a schema of its own on the test PostgreSQL
(created here, dropped at the end), Django configured from djsettings, its tables migrated,
flowlock's engine opened (which makes flowlock's tables), and a superuser.

Used through the `django_project` fixture (tests/conftest.py). Django stays configured for the
rest of the process; nothing else in the suite configures it.
"""

from __future__ import annotations

import importlib
import os
import uuid
from typing import Any

import psycopg

PASSWORD = "flowlock-admin-pw"
USER = "ops"
_state: dict[str, str] = {}


def ready(pg_url: str) -> str:
    """Set the project up (once); its schema. Django is configured from djsettings's values
    (settings.configure), and os.environ is left as it was: a DJANGO_SETTINGS_MODULE left there
    would reach the Django projects other tests start (the README's, under gunicorn)."""
    if "schema" in _state:
        return _state["schema"]
    schema = f"dj_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    _state["schema"] = schema
    _state["url"] = pg_url
    saved = {k: os.environ.get(k) for k in ("FLOWLOCK_DJANGO_SCHEMA", "FLOWLOCK_TEST_DATABASE_URL")}
    os.environ.update(FLOWLOCK_DJANGO_SCHEMA=schema, FLOWLOCK_TEST_DATABASE_URL=pg_url)
    try:
        values = vars(importlib.import_module("djsettings"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    from django.conf import settings
    from django.core.management import call_command

    import django

    settings.configure(**{k: v for k, v in values.items() if k.isupper()})
    django.setup()
    call_command("migrate", run_syncdb=True, verbosity=0)
    from django.contrib.auth.models import User

    from flowlock.contrib.django import engine

    engine().open()  # flowlock's tables, in the same schema
    User.objects.create_superuser(USER, "ops@example.invalid", PASSWORD)
    return schema


def finish() -> None:
    """Close the engine and Django's connections, drop the schema."""
    if "schema" not in _state:
        return
    from django.db import connections

    from flowlock.contrib.django import close

    close()
    connections.close_all()
    with psycopg.connect(_state["url"], autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{_state["schema"]}" CASCADE')
    _state.clear()


def other_connection() -> psycopg.Connection[Any]:
    """A connection of its own (not Django's), on the project's schema: what another process
    would see."""
    conn = psycopg.connect(_state["url"], autocommit=True)
    conn.execute(f'SET search_path = "{_state["schema"]}"')
    return conn


def url() -> str:
    """The test server's URL."""
    return _state["url"]
