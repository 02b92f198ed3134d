"""tests/django's project, set up once per test run: a schema of its own on the test PostgreSQL
(created here, dropped at the end), Django configured from djsettings, its tables migrated,
flowlock's engine opened (which makes flowlock's tables), and a superuser.

Used through the `django_project` fixture (tests/conftest.py). Django stays configured for the
rest of the process; nothing else in the suite configures it.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg

PASSWORD = "flowlock-admin-pw"
USER = "ops"
_state: dict[str, str] = {}


def ready(pg_url: str) -> str:
    """Set the project up (once); its schema."""
    if "schema" in _state:
        return _state["schema"]
    schema = f"dj_{uuid.uuid4().hex[:12]}"
    os.environ["FLOWLOCK_DJANGO_SCHEMA"] = schema
    os.environ["FLOWLOCK_TEST_DATABASE_URL"] = pg_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "djsettings"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    _state["schema"] = schema
    _state["url"] = pg_url
    from django.core.management import call_command

    import django

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
