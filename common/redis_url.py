"""Where Redis is and how to log in: the URL forms every service accepts, and the clients built from them.

URL forms (``--redis-url`` or ``CONVEYOR_REDIS_URL``):

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS; the CA and a client
  certificate as query parameters: ``?ssl_ca_certs=/ca.crt&ssl_certfile=...&ssl_keyfile=...``) and
  ``unix:///path/redis.sock``: redis-py's own forms, handed to it as they are.
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?options]``
  (``rediss+sentinel://`` for TLS to the sentinels and the servers; ports default to 26379): the
  master of ``service`` as the sentinels know it. Every new connection asks them again, so after a
  failover the clients follow the promoted replica. The user info is the servers' login; the
  sentinels' own password, if they have one, is ``?sentinel_password=...``. Other query options
  are redis-py's, as for ``redis://``.
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?options]``
  (``rediss+cluster://`` for TLS, the same query options as ``rediss://``; ports default to 6379):
  a Redis Cluster, found through any of the listed nodes (redis-py's ``RedisCluster``). Keys are
  laid out so that every script and multi-key read stays in one slot (`common.protocol.Names`).

The password may be left out of the URL: it is then ``CONVEYOR_REDIS_PASSWORD``, or the contents
of the file named by ``CONVEYOR_REDIS_PASSWORD_FILE`` (a mounted secret), so it appears neither on
a command line nor in the URL. A password in the URL wins. `setup_logging` redacts it from logs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote, urlencode

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster as cluster
import redis.sentinel as sentinel
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from common.redact import redact_url

try:  # redis-py >= 7.2: each new connection reads the package's metadata for CLIENT SETINFO unless given this
    from redis.driver_info import DriverInfo
except ImportError:  # older redis-py reads it once, at import
    DriverInfo = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

PASSWORD_ENV = "CONVEYOR_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "CONVEYOR_REDIS_PASSWORD_FILE"
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
SENTINEL_PORT = 26379
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
CLUSTER_PORT = 6379
# redis-py's sync cluster client reads the slot map when made, so a process started while its
# cluster forms (compose starts them together) waits up to this long for a node to answer.
CLUSTER_DISCOVERY_S = 60.0
# Asking a sentinel where the master is takes a round trip; a sentinel that does not answer within
# this is skipped for the next one, rather than holding every reconnect for a full socket timeout.
SENTINEL_TIMEOUT_S = 2.0
URL_HELP = (
    "redis://[[user]:password@]host[:port][/db], rediss://... (TLS), unix:///path, or "
    "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db] for a master found by "
    "Redis Sentinel, or redis+cluster://[[user]:password@]host[:port][,host[:port]...] for a Redis Cluster. "
    f"The password may come from ${PASSWORD_ENV} or the file ${PASSWORD_FILE_ENV} instead"
)


class RedisUrlError(ValueError):
    """A Redis URL or password setting that cannot work; the message never shows the password."""


@dataclass(slots=True)
class RedisUrl:
    """A parsed ``--redis-url``. ``sentinels`` and ``cluster_nodes`` are empty for redis-py's own
    forms (``url`` is then used as it is); for the sentinel form, ``master_options`` are the keyword
    arguments of the connections to the master (login, db, TLS) and ``sentinel_options`` those to
    the sentinels. For the cluster form, ``cluster_nodes`` are the nodes to discover it from and
    ``node_url`` the first of them as a plain URL carrying the login and options of every node."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    master_options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, Any] = field(default_factory=dict)
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    node_url: str = ""


def parse_redis_url(url: str) -> RedisUrl:
    """``url`` checked and taken apart; raises `RedisUrlError` saying what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in CLUSTER_SCHEMES:
        return _parse_cluster_url(url, CLUSTER_SCHEMES[scheme.lower()], rest)
    if scheme.lower() not in SENTINEL_SCHEMES:
        try:
            parse_url(url)  # redis://, rediss://, unix://: redis-py says what it accepts
        except ValueError as exc:
            raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: {exc}; expected {URL_HELP}") from None
        return RedisUrl(url)
    tls = SENTINEL_SCHEMES[scheme.lower()]
    location, _, query = rest.partition("?")
    userinfo, at, hosts_path = location.rpartition("@")
    hosts, _, path = hosts_path.partition("/")
    service, _, db = path.partition("/")
    if not hosts or not service:
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: the sentinel form needs host[:port][,...]/service")
    sentinels = tuple(_host_port(part, url, SENTINEL_PORT) for part in hosts.split(","))
    params = parse_qsl(query, keep_blank_values=True)
    sentinel_password = dict(params).get("sentinel_password")
    rest_query = urlencode([(k, v) for k, v in params if k != "sentinel_password"])
    # The master's options parsed as redis-py parses a plain URL (login, db, query types).
    plain = f"{'rediss' if tls else 'redis'}://{userinfo + at}placeholder/{db or 0}?{rest_query}"
    try:
        master = parse_url(plain)
    except ValueError as exc:
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: {exc}") from None
    del master["host"]  # the sentinels say where the master is
    master.pop("port", None)
    if master.pop("connection_class", None) is not None:  # rediss: the sentinel pool picks its TLS class
        master["ssl"] = True
    tls_options = {k: v for k, v in master.items() if k.startswith("ssl")}
    sentinel_options: dict[str, Any] = {**tls_options, "socket_timeout": SENTINEL_TIMEOUT_S}
    sentinel_options["socket_connect_timeout"] = SENTINEL_TIMEOUT_S
    if sentinel_password:
        sentinel_options["password"] = unquote(sentinel_password)
    return RedisUrl(url, sentinels, unquote(service), master, sentinel_options)


def _parse_cluster_url(url: str, tls: bool, rest: str) -> RedisUrl:
    location, _, query = rest.partition("?")
    userinfo, at, hosts_path = location.rpartition("@")
    hosts, _, path = hosts_path.partition("/")
    if not hosts:
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: the cluster form needs host[:port][,...]")
    if path not in ("", "0"):  # a cluster has only database 0
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: a Redis Cluster has no database {path!r}, only 0")
    nodes = tuple(_host_port(part, url, CLUSTER_PORT) for part in hosts.split(","))
    host, port = nodes[0]
    host = f"[{host}]" if ":" in host else host
    node_url = f"{'rediss' if tls else 'redis'}://{userinfo + at}{host}:{port}" + (f"?{query}" if query else "")
    try:
        options = parse_url(node_url)
    except ValueError as exc:
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: {exc}") from None
    if options.get("db", 0) != 0:
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: a Redis Cluster has only database 0")
    return RedisUrl(url, cluster_nodes=nodes, node_url=node_url)


def _host_port(part: str, url: str, default_port: int) -> tuple[str, int]:
    host, colon, port = part.rpartition(":") if not part.endswith("]") else (part, "", "")
    if not colon:
        host, port = part, str(default_port)
    host = host.strip("[]")  # an IPv6 address in brackets
    if not host or not port.isdigit():
        raise RedisUrlError(f"bad Redis URL {redact_url(url)!r}: node address {part!r} is not host[:port]")
    return host, int(port)


def redis_password(environ: Mapping[str, str] | None = None) -> str | None:
    """The password from the environment (``CONVEYOR_REDIS_PASSWORD``, or the file named by
    ``CONVEYOR_REDIS_PASSWORD_FILE`` without its trailing newline); None when neither is set."""
    env = os.environ if environ is None else environ
    value, path = env.get(PASSWORD_ENV), env.get(PASSWORD_FILE_ENV)
    if value and path:
        raise RedisUrlError(f"set one of {PASSWORD_ENV} and {PASSWORD_FILE_ENV}, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().rstrip("\r\n") or None
        except OSError as exc:
            raise RedisUrlError(f"cannot read the Redis password file {PASSWORD_FILE_ENV}={path}: {exc.strerror}") from None
    return value or None


def check_redis_url(url: str) -> str:
    """``url`` if it and the password settings can work (an argparse ``type=``); else `RedisUrlError`."""
    parse_redis_url(url)
    redis_password()
    return url


class _BlockingSentinelPool(sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """A sentinel-managed pool that waits for a free connection, like `redis.BlockingConnectionPool`."""


class _AsyncBlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """`_BlockingSentinelPool` for ``redis.asyncio``."""


class _Face(NamedTuple):
    """The redis-py classes of one face (sync or asyncio)."""

    client: Any
    cluster: Any
    cluster_node: Any
    pool: Any
    blocking_pool: Any
    sentinel: Any
    sentinel_pool: Any
    blocking_sentinel_pool: Any


_SYNC = _Face(
    redis.Redis,
    cluster.RedisCluster,
    cluster.ClusterNode,
    redis.ConnectionPool,
    redis.BlockingConnectionPool,
    sentinel.Sentinel,
    sentinel.SentinelConnectionPool,
    _BlockingSentinelPool,
)
_ASYNC = _Face(
    aioredis.Redis,
    aiocluster.RedisCluster,
    aiocluster.ClusterNode,
    aioredis.ConnectionPool,
    aioredis.BlockingConnectionPool,
    aiosentinel.Sentinel,
    aiosentinel.SentinelConnectionPool,
    _AsyncBlockingSentinelPool,
)


def _client(
    face: _Face, url: str, pool_timeout_s: float | None, environ: Mapping[str, str] | None, options: dict[str, Any]
) -> Any:
    target = parse_redis_url(url)
    password = redis_password(environ)
    if password is not None:
        options = {"password": password, **options}  # under the URL's: a password in the URL wins
    blocking = pool_timeout_s is not None
    if blocking:
        options["timeout"] = pool_timeout_s
    if DriverInfo is not None:
        # Resolved here once: redis-py would read its version from the package metadata for every new
        # connection, and a gateway opens dozens in its first burst, and again after a Redis restart.
        options.setdefault("driver_info", DriverInfo(lib_version=redis.__version__))
    if target.cluster_nodes:
        return _cluster_client(face, target, options)
    if not target.sentinels:
        pool = (face.blocking_pool if blocking else face.pool).from_url(url, **options)
        return face.client(connection_pool=pool)
    manager = face.sentinel(target.sentinels, sentinel_kwargs=target.sentinel_options)
    pool_class = face.blocking_sentinel_pool if blocking else face.sentinel_pool
    return manager.master_for(
        target.service, redis_class=face.client, connection_pool_class=pool_class, **{**options, **target.master_options}
    )


def _cluster_client(face: _Face, target: RedisUrl, options: dict[str, Any]) -> Any:
    """A ``RedisCluster`` found through ``target.cluster_nodes``; each node's connections made as
    ``target.node_url`` says (login, TLS), so whichever node a slot moves to is reached alike."""
    others = [face.cluster_node(host, port) for host, port in target.cluster_nodes[1:]]
    if face is _SYNC and "timeout" in options:  # a pool that waits for a free connection, per node
        options["connection_pool_class"] = redis.BlockingConnectionPool
    elif face is _ASYNC:
        # The asyncio cluster client keeps its own per-node connection list and fails a call at
        # once when it is full (a transient error, retried): it cannot wait for a free connection.
        options.pop("timeout", None)
    if face is _ASYNC:  # reads the slot map at its first command
        return face.cluster.from_url(target.node_url, startup_nodes=others, **options)
    deadline, delay = time.monotonic() + CLUSTER_DISCOVERY_S, 0.1
    while True:
        try:
            return face.cluster.from_url(target.node_url, startup_nodes=list(others), **options)
        except RedisClusterException as exc:
            if time.monotonic() + delay > deadline:
                raise redis.ConnectionError(f"no Redis Cluster at {redact_url(target.url)}: {exc}") from None
            logger.warning("Redis Cluster not reachable yet (%s); retrying in %.1fs", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def sync_client(
    url: str, *, pool_timeout_s: float | None = None, environ: Mapping[str, str] | None = None, **options: Any
) -> redis.Redis:
    """A redis-py client for ``url`` (any form of `parse_redis_url`), the password from the
    environment if the URL has none. ``pool_timeout_s``: a pool that waits that long for a free
    connection (else one that fails at once when all are busy). ``options``: redis-py's."""
    client: redis.Redis = _client(_SYNC, url, pool_timeout_s, environ, options)
    return client


def async_client(
    url: str, *, pool_timeout_s: float | None = None, environ: Mapping[str, str] | None = None, **options: Any
) -> aioredis.Redis:
    """`sync_client` on ``redis.asyncio``."""
    client: aioredis.Redis = _client(_ASYNC, url, pool_timeout_s, environ, options)
    return client
