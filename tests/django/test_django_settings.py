"""The FLOWLOCK setting, read and checked (flowlock.contrib.django.conf): what each key takes,
the URL built from a DATABASES entry, the shapes a workflow path may name, and a clear
ImproperlyConfigured for anything else."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("django_project")


def _config(flowlock_setting: Any) -> Any:
    from django.test import override_settings

    from flowlock.contrib.django.conf import config

    with override_settings(FLOWLOCK=flowlock_setting):
        return config()


def test_the_projects_setting_reads_back() -> None:
    from django.conf import settings

    from flowlock.contrib.django.conf import config

    conf = config()
    assert conf.alias == "default" and conf.workflows == ("djapp.workflows",)
    assert conf.schema == settings.FLOWLOCK["OPTIONS"]["schema"]
    assert conf.url.startswith("postgresql://") and conf.url.endswith(
        "/" + settings.DATABASES["default"]["NAME"]
    )


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        (None, "needs a FLOWLOCK setting"),
        ({"DATABASES": "default"}, "unknown keys"),
        ({"DATABASE": "elsewhere"}, "not an alias of DATABASES"),
        ({"WORKFLOWS": [1]}, "dotted path"),
        ({"OPTIONS": ["schema"]}, "Engine.connect keywords"),
    ],
)
def test_a_bad_setting_is_improperly_configured(setting: Any, says: str) -> None:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match=says):
        _config(setting)


def test_urls_from_database_entries() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from flowlock.contrib.django.conf import url_of

    pg = "django.db.backends.postgresql"
    entry = {"ENGINE": pg, "NAME": "app", "USER": "me", "PASSWORD": "p@ss/w:rd", "HOST": "db",
             "PORT": "6432"}  # fmt: skip
    assert url_of(entry, "default") == "postgresql://me:p%40ss%2Fw%3Ard@db:6432/app"
    assert url_of({"ENGINE": pg, "NAME": "app"}, "default") == "postgresql://localhost/app"
    socket = {"ENGINE": pg, "NAME": "app", "USER": "me", "HOST": "/run/postgresql"}
    assert url_of(socket, "default") == "postgresql://me@/app?host=%2Frun%2Fpostgresql"
    with pytest.raises(ImproperlyConfigured, match="runs on PostgreSQL"):
        url_of({"ENGINE": "django.db.backends.sqlite3", "NAME": "x.db"}, "default")


def test_workflow_paths_of_every_shape() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from flowlock.contrib.django.conf import workflows_at

    def names(path: str) -> list[str]:
        return [w.name for w in workflows_at(path)]

    assert names("djapp.workflows") == ["approval", "tally", "errand"]
    assert names("djapp.more_workflows.one") == ["one"]
    assert names("djapp.more_workflows.several") == ["two", "three"]
    assert names("djapp.more_workflows.made") == ["four"]
    for bad, says in [
        ("djapp.more_workflows.not_a_workflow", "not a Workflow"),
        ("djapp.more_workflows.missing", "cannot import"),
        ("nowhere", "cannot import"),
    ]:
        with pytest.raises(ImproperlyConfigured, match=says):
            workflows_at(bad)
