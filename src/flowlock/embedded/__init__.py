"""Throwaway PostgreSQL and Redis servers, for tests and benchmarks.

::

    from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis

    with EmbeddedPostgres(max_connections=300) as pg:
        conn = await asyncpg.connect(pg.url)

    async with EmbeddedRedis() as server:  # start and stop run in a worker thread
        locks = RedisLocks(server.url)

Each server runs as a child process in a temporary directory of its own, on a free 127.0.0.1
port, and ``stop()`` (also at interpreter exit) leaves no process and no directory behind.
For fault tests both can be restarted on the same URL (``EmbeddedPostgres.restart()`` keeps the
data, ``EmbeddedRedis.restart()`` comes back empty unless ``keep_data=True``) and frozen with
``pause()`` (SIGSTOP; the whole PostgreSQL process tree) until ``resume()``. Any
failure to start or stop one, or a question to one that is not running, raises
:class:`flowlock.EmbeddedServerError` with what the server said; bad arguments raise
:class:`flowlock.InvalidInput`.

Modules: :mod:`~flowlock.embedded.process` (ports, child processes, readiness, ``/proc``),
:mod:`~flowlock.embedded.base` (the lifecycle both servers share),
:mod:`~flowlock.embedded.postgres` and :mod:`~flowlock.embedded.redis`; highly available Redis
(a Sentinel-watched primary with replicas, a Redis Cluster) for failover tests in
:mod:`~flowlock.embedded.redis_ha`.
"""

from __future__ import annotations

from flowlock.embedded.errors import EmbeddedServerError
from flowlock.embedded.postgres import EmbeddedPostgres, available
from flowlock.embedded.redis import EmbeddedRedis

__all__ = ["EmbeddedPostgres", "EmbeddedRedis", "EmbeddedServerError", "available"]
