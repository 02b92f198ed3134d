"""Where a lock lives in Redis.

Lock `k` is `flowlock:<ns>:{<k>}`, its fencing counter `...:fence`, and the counter's
stamp `...:fence:replid`. The hash tag keeps them in one cluster slot. Keys are
percent-encoded, so `a:b` and `a` + `:b` never meet.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import quote

__all__ = ["Keyspace"]


# Cached: every acquire, release and extend names its key again, and quote() is most of the
# cost of building it. The bound keeps a process that locks millions of keys small.
@lru_cache(maxsize=65536)
def _escape(part: str) -> str:
    return quote(part, safe="")


class Keyspace:
    """The Redis keys and release channels of one namespace's locks."""

    __slots__ = ("_prefix", "namespace")

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._prefix = f"flowlock:{_escape(namespace)}:"

    def lock(self, key: str) -> str:
        """The Redis key (and release channel) of lock `key`."""
        return f"{self._prefix}{{{_escape(key)}}}"

    def fence(self, key: str) -> str:
        """The Redis key of lock `key`'s fencing counter."""
        return self.all_three(key)[1]

    def stamp(self, key: str) -> str:
        """The key holding the replication id `key`'s fencing counter was started on."""
        return self.all_three(key)[2]

    def all_three(self, key: str) -> tuple[str, str, str]:
        """The lock key, its counter and the counter's stamp, escaping `key` once."""
        lock = self.lock(key)
        return lock, lock + ":fence", lock + ":fence:replid"

    def pattern(self) -> str:
        """A SCAN / PSUBSCRIBE pattern matching every key and channel of this namespace."""
        return self._prefix + "*"
