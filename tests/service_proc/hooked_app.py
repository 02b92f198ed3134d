"""The workflows ``flowlock serve --app hooked_app:workflows`` serves in the 5xx tests.

``counter`` has a step that raises (``boom``: a 500 step-failed) and one that waits for the test
between the service's read and its write (``hooked``): the test is told, over the Unix socket
named by ``HOOK_SOCKET``, each time the step runs, and answers once it has committed a
competing transition. So every compare-and-swap the service makes really loses, as many times as
the test likes. Plus the default workflows.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

import flowlock
from flowlock.service.app import default_workflows

SECRET = "password=hunter2 host=10.9.8.7 port=6543 dbname=secret_db"
"""What the raising step's error says: none of it may reach a client."""


def _wait_for_the_test(inst: flowlock.Instance, payload: Mapping[str, Any], actor: Any) -> Any:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30.0)
        conn.connect(os.environ["HOOK_SOCKET"])
        conn.sendall(f"{inst.version}\n".encode())
        if conn.recv(1) != b"g":
            raise RuntimeError("the test hung up")
    return {**inst.data, "hooked": int(inst.data.get("hooked", 0)) + 1}


def _fail(inst: flowlock.Instance, payload: Mapping[str, Any], actor: Any) -> Any:
    raise RuntimeError(SECRET)


def workflows() -> list[flowlock.Workflow]:
    counter = flowlock.Workflow(
        "counter",
        states=["on"],
        initial="on",
        transitions=[
            flowlock.Transition("hooked", source="on", target="on", effect=_wait_for_the_test),
            flowlock.Transition("tick", source="on", target="on"),
            flowlock.Transition("boom", source="on", target="on", effect=_fail),
        ],
    )
    return [counter, *default_workflows()]
