"""The Redis URLs the lock backend takes, checked in one place before any I/O.

One server: `redis://`, `rediss://` (TLS) or `unix://`. Sentinel:
`redis+sentinel://`. Cluster: `redis+cluster://`. docs/redis-ha.md shows every form.
TLS to a sentinel or cluster needs your own client and `RedisLocks.from_client`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from flowlock.core.errors import InvalidInput
from flowlock.core.settings import check_url

__all__ = ["CLUSTER", "SCHEMES", "SENTINEL", "SINGLE", "RedisAddress", "parse"]

SINGLE = ("redis", "rediss", "unix")
"""The schemes of one Redis server, read by redis-py's `from_url`."""
SENTINEL = "redis+sentinel"
CLUSTER = "redis+cluster"
SCHEMES = (*SINGLE, SENTINEL, CLUSTER)
"""Every scheme the Redis lock backend takes."""

SENTINEL_PORT = 26379
REDIS_PORT = 6379
_MAX_DB = 1 << 20  # far above any server's "databases" setting: a bigger one is a typo
_QUERY = {
    SENTINEL: ("service_name", "sentinel_password", "sentinel_username", "client_name"),
    CLUSTER: ("client_name",),
}

Kind = Literal["single", "sentinel", "cluster"]


@dataclass(frozen=True, slots=True, repr=False)
class RedisAddress:
    """Where the locks live, as a checked URL says.

    `url` is the URL itself, read by redis-py for one server. `hosts` are the sentinels
    or cluster nodes. The rest applies to the kinds that have it. The repr hides passwords.
    """

    kind: Kind
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    service_name: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    client_name: str | None = None

    def __repr__(self) -> str:
        where = ",".join(f"{host}:{port}" for host, port in self.hosts)
        service = f" service={self.service_name!r}" if self.service_name else ""
        return f"<RedisAddress {self.kind} {where or self.url.partition(':')[0]}{service}>"


def parse(url: object, name: str = "the Redis URL") -> RedisAddress:
    """`url` checked and taken apart.

    Raises InvalidInput saying what is wrong and how to write it. Messages never quote the
    whole URL, which may carry a password.
    """
    text = check_url(name, url, SCHEMES)
    scheme = text.partition("://")[0].lower()
    if scheme in SINGLE:
        return RedisAddress("single", text)
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # brackets that do not match, say
        raise _bad(name, scheme, f"it cannot be read as a URL ({exc})") from exc
    if parts.fragment:
        raise _bad(name, scheme, "it has a #fragment, which means nothing here")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    default_port = SENTINEL_PORT if scheme == SENTINEL else REDIS_PORT
    hosts = _hosts(name, scheme, hostlist, default_port)
    query = _query(name, scheme, parts.query)
    segments = [unquote(s) for s in parts.path.split("/")[1:]] if parts.path else []
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    client_name = query.get("client_name")
    if scheme == CLUSTER:
        if segments not in ([], ["0"]):
            raise _bad(name, scheme, "a Redis Cluster has database 0 only: leave the path out")
        return RedisAddress(
            "cluster", text, hosts, username=username, password=password, client_name=client_name
        )
    service, db = _service(name, query.get("service_name"), segments)
    return RedisAddress(
        "sentinel",
        text,
        hosts,
        service_name=service,
        db=db,
        username=username,
        password=password,
        sentinel_username=query.get("sentinel_username"),
        sentinel_password=query.get("sentinel_password"),
        client_name=client_name,
    )


def _bad(name: str, scheme: str, why: str) -> InvalidInput:
    how = (
        "redis+sentinel://[[user]:password@]host1:26379,host2:26379/service_name[/db]"
        if scheme == SENTINEL
        else "redis+cluster://[[user]:password@]host1:6379,host2:6379"
    )
    return InvalidInput(f"{name} ({scheme}://...) is malformed: {why}; write it as {how}")


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    """`user:password`, `:password` or `password` (Redis's AUTH takes a password alone)."""
    user, colon, password = userinfo.partition(":")
    if not colon:
        return None, unquote(userinfo) or None
    return unquote(user) or None, unquote(password) or None


def _hosts(name: str, scheme: str, hostlist: str, default_port: int) -> tuple[tuple[str, int], ...]:
    if not hostlist:
        raise _bad(name, scheme, "it names no host")
    hosts = []
    for entry in hostlist.split(","):
        if not entry:
            raise _bad(name, scheme, "its host list has an empty entry (two commas?)")
        if entry.startswith("["):  # [IPv6]:port
            host, bracket, rest = entry[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise _bad(name, scheme, f"host {entry!r} is not [IPv6 address]:port")
            port_text = rest[1:] if rest else ""
        else:
            host, colon, port_text = entry.rpartition(":")
            if not colon:
                host, port_text = entry, ""
        if not host:
            raise _bad(name, scheme, f"{entry!r} has a port but no host")
        hosts.append((unquote(host), _port(name, scheme, entry, port_text, default_port)))
    return tuple(hosts)


def _port(name: str, scheme: str, entry: str, text: str, default: int) -> int:
    if not text:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad(name, scheme, f"the port of {entry!r} is not a number from 1 to 65535")
    return int(text)


def _query(name: str, scheme: str, query: str) -> dict[str, str]:
    known = _QUERY[scheme]
    found: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in known:
            raise _bad(
                name, scheme, f"?{key}= is not a setting of it (it takes {', '.join(known)})"
            )
        if key in found:
            raise _bad(name, scheme, f"?{key}= is given twice")
        if not value:
            raise _bad(name, scheme, f"?{key}= is empty")
        found[key] = value
    return found


def _service(name: str, given: str | None, segments: list[str]) -> tuple[str, int]:
    """The service name and database, from the path or `?service_name=`."""
    if given is None:
        if not segments or not segments[0]:
            raise _bad(name, SENTINEL, "it names no service (the sentinels' name of the primary)")
        given, segments = segments[0], segments[1:]
    elif segments and not segments[0].isdigit():
        raise _bad(name, SENTINEL, "it names the service both in its path and in ?service_name=")
    if len(segments) > 1:
        raise _bad(name, SENTINEL, "its path has more than /service_name/db")
    db = 0
    if segments:
        if not segments[0].isdigit() or int(segments[0]) > _MAX_DB:
            raise _bad(name, SENTINEL, f"database {segments[0]!r} is not a whole number")
        db = int(segments[0])
    return given, db
