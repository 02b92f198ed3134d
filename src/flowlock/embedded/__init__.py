"""Throwaway PostgreSQL and Redis servers, for tests and benchmarks.


    from flowlock.embedded import EmbeddedPostgres, EmbeddedRedis

    with EmbeddedPostgres(max_connections=300) as pg:
        conn = await asyncpg.connect(pg.url)

    async with EmbeddedRedis() as server:  # start and stop run in a worker thread
        locks = RedisLocks(server.url)

Each server is a child process in its own temporary directory, on a free 127.0.0.1 port.
`stop()`, also run at exit, leaves no process or directory behind. For fault tests,
`restart()` keeps the URL, and `pause()` freezes a server until `resume()`.
`EmbeddedPostgres.restart()` keeps the data; `EmbeddedRedis.restart()` comes back
empty unless `keep_data=True`. Server failures raise
[`EmbeddedServerError`][flowlock.embedded.EmbeddedServerError] with what the server said. Bad
arguments raise [`flowlock.InvalidInput`][flowlock.InvalidInput].

Modules: `process` (ports, processes, readiness),
`base` (the shared lifecycle), `postgres` and
`redis`. Sentinel and Cluster servers live in the lab.
"""

from __future__ import annotations

from flowlock.embedded.errors import EmbeddedServerError
from flowlock.embedded.postgres import EmbeddedPostgres, available
from flowlock.embedded.redis import EmbeddedRedis

__all__ = ["EmbeddedPostgres", "EmbeddedRedis", "EmbeddedServerError", "available"]
