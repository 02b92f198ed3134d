"""Where a lock lives in Redis.

Everything lives under `flowlock:<namespace>:`. The user's key (and the namespace) are
percent-encoded, so `:`, `{`, `}` and glob characters never appear raw: `a:b` and
`a` + `:b` can never meet. The lock of key `k` is `flowlock:<ns>:{<k>}` and its fencing
counter `flowlock:<ns>:{<k>}:fence` (and, with fencing epochs, the counter's stamp
`flowlock:<ns>:{<k>}:fence:replid`); the `{...}` hash tag keeps them in one Redis Cluster
slot, which the scripts need. The lock key is also the pub/sub channel its release is
announced on (channels and keys are separate name spaces in Redis).
"""

from __future__ import annotations

from urllib.parse import quote

__all__ = ["Keyspace"]


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
        return self.lock(key) + ":fence"

    def stamp(self, key: str) -> str:
        """The Redis key of the replication id that lock `key`'s fencing counter was started
        on (see `fence`)."""
        return self.lock(key) + ":fence:replid"

    def pattern(self) -> str:
        """A SCAN / PSUBSCRIBE pattern matching every key and channel of this namespace."""
        return self._prefix + "*"
