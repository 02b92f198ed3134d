"""flowlock in a Django project: an app whose engine is opened from settings, read-only admin
pages for the instances with actions that fire an event or force a state, and transitions
that commit with a view's own rows (`engine().fire(..., connection=django.db.connection)`
inside `transaction.atomic()`).

Add `"flowlock.contrib.django"` to `INSTALLED_APPS` and a `FLOWLOCK` setting; the Django guide
(docs/django.md) says what each key does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowlock.core.extras import require

require("django", "django", "flowlock.contrib.django")

if TYPE_CHECKING:
    from flowlock.sync import Engine

__all__ = ["close", "engine"]


def engine() -> Engine:
    """The project's engine (a [`flowlock.sync.Engine`][flowlock.sync.Engine]), built from the
    `FLOWLOCK` setting on the first call, with the configured workflows registered. It connects
    on its first call that needs the database, so a server that forks its workers after loading
    the project gives each worker its own connections."""
    from flowlock.contrib.django.conf import project_engine

    return project_engine()


def close() -> None:
    """Close the project's engine, if it was built (it is closed at exit anyway). The next
    `engine()` builds a new one."""
    from flowlock.contrib.django.conf import close_engine

    close_engine()
