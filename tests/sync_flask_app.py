"""A small Flask app sharing one ``flowlock.sync.Engine`` between the threads of a WSGI server,
as a user's app would: the engine is built at module level and opens itself on the first request.

``tests/integration/test_sync_api.py`` runs it as a separate process::

    FLOWLOCK_TEST_DATABASE_URL=... FLOWLOCK_SYNC_APP_SCHEMA=... python tests/sync_flask_app.py

It serves on a free 127.0.0.1 port with werkzeug's threaded server (a thread per request), prints
``port N`` once it listens, and on SIGINT stops serving and exits normally, so the engine is
closed by flowlock's exit hook; it prints ``engine closed at exit: True`` when that happened.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from flask import Flask, jsonify, request
from flask.typing import ResponseReturnValue
from werkzeug.serving import make_server

import flowlock
from flowlock.http import problem

engine = flowlock.sync.Engine.connect(
    os.environ["FLOWLOCK_TEST_DATABASE_URL"],
    schema=os.environ["FLOWLOCK_SYNC_APP_SCHEMA"],
)
engine.register(flowlock.examples.approval())
engine.register(flowlock.examples.inventory())

app = Flask(__name__)


@app.errorhandler(flowlock.FlowlockError)
def flowlock_error(exc: flowlock.FlowlockError) -> ResponseReturnValue:
    # The service's statuses and problem bodies: 409 not allowed, 422 a guard said no, 503
    # with Retry-After for what a retry may fix.
    status, body, headers = problem(exc, instance=request.path)
    return body, status, headers


@app.post("/instances/<instance_id>/events/<event>")
def fire(instance_id: str, event: str) -> ResponseReturnValue:
    body: dict[str, Any] = request.get_json(silent=True) or {}
    outcome = engine.fire(
        instance_id,
        event,
        actor=body.get("actor"),
        request_id=request.headers.get("Idempotency-Key"),
        payload=body.get("payload"),
        strategy=body.get("strategy"),
    )
    inst = outcome.instance
    return jsonify(
        applied=outcome.applied,
        idempotent=outcome.idempotent,
        state=inst.state,
        version=inst.version,
        data=dict(inst.data),
    )


def _report() -> None:
    # Registered after flowlock's exit hook, which the threading module runs first.
    print(f"engine closed at exit: {engine.closed}", flush=True)


if __name__ == "__main__":
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(f"port {server.server_port}", flush=True)
    atexit.register(_report)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
