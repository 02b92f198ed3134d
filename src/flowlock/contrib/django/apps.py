"""The app's configuration: `INSTALLED_APPS = [..., "flowlock.contrib.django"]`."""

from __future__ import annotations

from django.apps import AppConfig


class FlowlockConfig(AppConfig):
    """flowlock's Django app (label "flowlock"): checks the `FLOWLOCK` setting and registers
    its workflows when Django starts; the engine connects on its first call (after a server
    forks its workers, in each worker), and is closed at exit like every sync engine."""

    name = "flowlock.contrib.django"
    label = "flowlock"
    verbose_name = "flowlock"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from flowlock.contrib.django.conf import project_engine

        # Built now, so a bad setting or workflow path fails at startup, not on a request.
        project_engine()
