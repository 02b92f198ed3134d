"""The Django settings of tests/django: a project on the test PostgreSQL, every table (Django's
own and flowlock's) in a schema of the run's own (FLOWLOCK_DJANGO_SCHEMA), so the run shares
nothing with other tests on the same server. Read by the test process (dj_kit.ready) and by the
Django server the tests start."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

SCHEMA = os.environ["FLOWLOCK_DJANGO_SCHEMA"]
_url = urlsplit(os.environ["FLOWLOCK_TEST_DATABASE_URL"])

SECRET_KEY = "flowlock-tests-only-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
TIME_ZONE = "Europe/Paris"  # not UTC: flowlock's times must come back right whatever it is
ROOT_URLCONF = "djurls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "flowlock.contrib.django",
    "djapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(_url.path.lstrip("/")),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
        # Django's tables in the run's schema; flowlock's too (OPTIONS' schema below).
        "OPTIONS": {"options": f"-c search_path={SCHEMA}"},
    }
}
FLOWLOCK = {
    "DATABASE": "default",
    "WORKFLOWS": "djapp.workflows",
    "OPTIONS": {"schema": SCHEMA, "max_size": 12},
}
