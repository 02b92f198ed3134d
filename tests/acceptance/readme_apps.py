"""The README's Flask and Django examples as a user builds them: project files on disk, written
from the README's blocks, served by gunicorn (as the README says), called over HTTP.

`flask_project` and `django_project` write the projects; `serve` runs gunicorn on a free port
until the block ends; `FlaskApi` and `DjangoApi` speak each app's dialect (paths, who the user
is, CSRF) so that one set of tests drives both.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from doc_blocks import app_files

BIN = Path(sys.executable).parent
START_TIMEOUT = 60.0
_LISTENING = re.compile(r"Listening at: (http://127\.0\.0\.1:\d+)")


def write_files(project: Path, section: str) -> list[str]:
    """Write the file blocks of the README's `section` into `project`; the paths written."""
    written: list[str] = []
    for block in app_files(section):
        assert block.file is not None
        path = project / block.file
        path.parent.mkdir(parents=True, exist_ok=True)
        if block.appends:
            with path.open("a", encoding="utf-8") as out:
                out.write("\n" + block.code)
        else:
            path.write_text(block.code, encoding="utf-8")
        written.append(block.file)
    return written


def flask_project(project: Path) -> None:
    """The Flask example: one file, app.py."""
    assert write_files(project, "### Flask") == ["app.py"]


def django_project(project: Path, env: Mapping[str, str], users: Mapping[str, str]) -> None:
    """The Django example in a project made as the README says (startproject, startapp), its
    tables migrated and `users` (name: password) created as staff, who log in at the admin."""
    _run(project, env, BIN / "django-admin", "startproject", "mysite", ".")
    _run(project, env, sys.executable, "manage.py", "startapp", "approvals")
    written = write_files(project, "### Django")
    assert sorted(written) == sorted(
        ["mysite/settings.py", "approvals/apps.py", "approvals/views.py", "approvals/urls.py",
         "mysite/urls.py"]
    )  # fmt: skip
    _run(project, env, sys.executable, "manage.py", "migrate", "-v0")
    for name, password in users.items():
        _run(
            project,
            {**env, "DJANGO_SUPERUSER_PASSWORD": password},
            sys.executable, "manage.py", "createsuperuser", "--noinput",
            "--username", name, "--email", f"{name}@example.com",
        )  # fmt: skip


def _run(cwd: Path, env: Mapping[str, str], *args: str | Path) -> None:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"


@dataclass
class Server:
    """A gunicorn serving an example: its URL and what it logged so far."""

    url: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        """Everything gunicorn and the app wrote to stderr so far."""
        return "".join(self.lines)


@contextmanager
def serve(project: Path, app: str, env: Mapping[str, str]) -> Iterator[Server]:
    """`gunicorn --threads 8 APP` in `project`, as the README serves it, on a free port; the
    URL is read from gunicorn's "Listening at" line. Stopped with SIGTERM at the end."""
    command = [str(BIN / "gunicorn"), "--threads", "8", "--bind", "127.0.0.1:0", app]
    process = subprocess.Popen(
        command, cwd=project, env=dict(env), stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    lines: list[str] = []
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            match = _LISTENING.search(line)
            if match:
                found.put(match[1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        try:
            url = found.get(timeout=START_TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"gunicorn did not listen: {''.join(lines)}") from None
        yield Server(url, process, lines)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=10)
        process.stderr.close()


def environment(**extra: str) -> dict[str, str]:
    """The test's environment for a server: this venv first on PATH, no warnings as errors."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONWARNINGS")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


class Api:
    """One example app over HTTP: create an approval, fire an event, as a user or anonymously."""

    create_path = "/approvals"

    def __init__(self, url: str) -> None:
        self.url = url

    def client(self, user: str | None) -> httpx.Client:
        """A client acting as `user` (None: anonymous)."""
        raise NotImplementedError

    def create(self, client: httpx.Client, body: Any, key: str | None = None) -> httpx.Response:
        headers = {} if key is None else {"Idempotency-Key": key}
        return client.post(self.create_path, json=body, headers=headers)

    def fire(
        self,
        client: httpx.Client,
        approval_id: str,
        event: str,
        key: str | None = None,
        payload: Any = None,
    ) -> httpx.Response:
        headers = {} if key is None else {"Idempotency-Key": key}
        path = f"/approvals/{approval_id}/{event}"
        return client.post(path, json={} if payload is None else payload, headers=headers)


class FlaskApi(Api):
    """The Flask example: the user is the X-User header an authenticating proxy would set."""

    def client(self, user: str | None) -> httpx.Client:
        headers = {} if user is None else {"X-User": user}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


class DjangoApi(Api):
    """The Django example: the user logs in at the admin's login page (a session cookie), and
    every POST carries the csrftoken cookie's value in X-CSRFToken, as a page's script does."""

    create_path = "/approvals/"

    def __init__(self, url: str, passwords: Mapping[str, str]) -> None:
        super().__init__(url)
        self.passwords = passwords

    def client(self, user: str | None) -> httpx.Client:
        with httpx.Client(base_url=self.url, timeout=60) as browser:
            page = browser.get("/admin/login/")
            assert page.status_code == 200, page.text
            if user is not None:
                token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
                assert token is not None
                login = browser.post(
                    "/admin/login/",
                    data={
                        "username": user,
                        "password": self.passwords[user],
                        "csrfmiddlewaretoken": token[1],
                        "next": "/admin/",
                    },
                )
                assert login.status_code == 302, login.text  # to /admin/: logged in
                assert "sessionid" in browser.cookies
            cookies = httpx.Cookies(browser.cookies)
        # The page's script: the csrftoken cookie's value in X-CSRFToken on every POST.
        headers = {"X-CSRFToken": cookies["csrftoken"]}
        return httpx.Client(base_url=self.url, cookies=cookies, headers=headers, timeout=60)


def timed_post(
    call: Callable[..., httpx.Response], *args: Any, **kwargs: Any
) -> tuple[float, httpx.Response, float]:
    """`call(*args, **kwargs)` with the monotonic time before and after it."""
    began = time.monotonic()
    answer = call(*args, **kwargs)
    return began, answer, time.monotonic()
