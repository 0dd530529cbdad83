"""`common.redis_url`: the URL forms, the password from the environment, and that neither a bad URL
nor a log record shows the password."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.cluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel as sentinel
from redis.connection import parse_url

from common.redact import redact_url
from common.redis_url import (
    CLUSTER_PORT,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    SENTINEL_PORT,
    DriverInfo,
    RedisUrlError,
    async_client,
    parse_redis_url,
    redis_password,
    sync_client,
)
from infra.stack import REPO, find_redis
from scheduler.cli import build_parser

pytestmark = pytest.mark.unit

SECRET = "s3cr3t-in-url"


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", f"rediss://:{SECRET}@redis.example:6380/2?ssl_ca_certs=/ca.pem", "unix:///run/r.sock"]
)
def test_redis_py_forms_pass_through(url: str) -> None:
    parsed = parse_redis_url(url)
    assert parsed.url == url and parsed.sentinels == ()


def test_sentinel_form() -> None:
    url = f"rediss+sentinel://app:{SECRET}@s1,s2:26380,[::1]:26381/my%20master/3?sentinel_password=sp&socket_timeout=1.5"
    parsed = parse_redis_url(url)
    assert parsed.sentinels == (("s1", SENTINEL_PORT), ("s2", 26380), ("::1", 26381))
    assert parsed.service == "my master"
    assert parsed.master_options["username"] == "app" and parsed.master_options["password"] == SECRET
    assert parsed.master_options["db"] == 3 and parsed.master_options["ssl"] is True
    assert parsed.master_options["socket_timeout"] == 1.5  # query options typed as redis-py types them
    assert parsed.sentinel_options["password"] == "sp" and parsed.sentinel_options["ssl"] is True
    assert "sentinel_password" not in parsed.master_options


def test_sentinel_form_defaults() -> None:
    parsed = parse_redis_url("redis+sentinel://10.0.0.1/mymaster")
    assert parsed.sentinels == (("10.0.0.1", SENTINEL_PORT),)
    assert parsed.master_options == {"db": 0}
    assert "password" not in parsed.sentinel_options and "ssl" not in parsed.sentinel_options


def test_cluster_form() -> None:
    url = f"rediss+cluster://app:{SECRET}@n1,n2:7001,[::1]:7002/0?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
    parsed = parse_redis_url(url)
    assert parsed.cluster_nodes == (("n1", CLUSTER_PORT), ("n2", 7001), ("::1", 7002)) and parsed.sentinels == ()
    options = parse_url(parsed.node_url)  # every node's connections: the login and TLS of the URL
    assert options["host"] == "n1" and options["port"] == CLUSTER_PORT
    assert options["username"] == "app" and options["password"] == SECRET
    assert options["ssl_ca_certs"] == "/ca.pem" and options["ssl_certfile"] == "/c.pem" and options["ssl_keyfile"] == "/k.pem"
    assert parse_redis_url("redis+cluster://10.0.0.1:7000").node_url == "redis://10.0.0.1:7000"


def test_cluster_clients_are_made_as_the_url_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients a cluster URL gives (no cluster runs: the constructors are recorded)."""
    made: list[tuple[str, str, dict[str, Any]]] = []

    def fake(face: str) -> Any:
        return classmethod(lambda cls, url, **kw: made.append((face, url, kw)) or "client")

    monkeypatch.setattr(redis.cluster.RedisCluster, "from_url", fake("sync"))
    monkeypatch.setattr(redis.asyncio.cluster.RedisCluster, "from_url", fake("async"))
    env = {PASSWORD_ENV: "from-env"}
    assert sync_client("redis+cluster://n1:7000,n2:7001", environ=env, pool_timeout_s=3.0, socket_timeout=2) == "client"
    assert async_client(f"rediss+cluster://:{SECRET}@n1:7000", environ=env, pool_timeout_s=3.0) == "client"
    (face, url, kw), (aface, aurl, akw) = made
    assert face == "sync" and url == "redis://n1:7000" and kw["password"] == "from-env" and kw["socket_timeout"] == 2
    assert [(n.host, n.port) for n in kw["startup_nodes"]] == [("n2", 7001)]
    assert kw["connection_pool_class"] is redis.BlockingConnectionPool and kw["timeout"] == 3.0  # waits for a connection
    assert aface == "async" and aurl == f"rediss://:{SECRET}@n1:7000" and "timeout" not in akw
    assert akw["startup_nodes"] == [] and akw["password"] == "from-env"  # the URL's password wins all the same (parsed later)


@pytest.mark.parametrize(
    "url, why",
    [
        (f"http://:{SECRET}@host:6379", "bad Redis URL"),
        (f"redis+sentinel://:{SECRET}@host:26379", "needs host"),
        (f"redis+sentinel://:{SECRET}@host:port/mymaster", "not host[:port]"),
        (f"redis+sentinel://:{SECRET}@h1,,h2/mymaster", "not host[:port]"),
        (f"redis+cluster://:{SECRET}@", "needs host"),
        (f"redis+cluster://:{SECRET}@h1:7000/2", "no database"),
        (f"rediss+cluster://:{SECRET}@h1:70x0,h2", "not host[:port]"),
        (f"redis+cluster://:{SECRET}@h1?db=3", "only database 0"),
    ],
)
def test_bad_urls_say_why_without_the_password(url: str, why: str) -> None:
    with pytest.raises(RedisUrlError, match=why.replace("[", r"\[")) as info:
        parse_redis_url(url)
    assert SECRET not in str(info.value)


def test_cli_rejects_a_bad_url_without_showing_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--redis-url", f"redis+sentinel://:{SECRET}@h/"])
    err = capsys.readouterr().err
    assert "--redis-url" in err and "needs host" in err and SECRET not in err


def test_password_from_environment(tmp_path: Path) -> None:
    assert redis_password({}) is None
    assert redis_password({PASSWORD_ENV: "pw"}) == "pw"
    secret_file = tmp_path / "pw"
    secret_file.write_text("from-file\n")  # a secret mounted as a file often ends in a newline
    assert redis_password({PASSWORD_FILE_ENV: str(secret_file)}) == "from-file"
    with pytest.raises(RedisUrlError, match="not both"):
        redis_password({PASSWORD_ENV: "pw", PASSWORD_FILE_ENV: str(secret_file)})
    with pytest.raises(RedisUrlError, match="cannot read the Redis password file"):
        redis_password({PASSWORD_FILE_ENV: str(tmp_path / "missing")})


def test_clients_take_the_environment_password_unless_the_url_has_one() -> None:
    env = {PASSWORD_ENV: "from-env"}
    assert sync_client("redis://h:6379/0", environ=env).connection_pool.connection_kwargs["password"] == "from-env"
    assert sync_client(f"redis://:{SECRET}@h/0", environ=env).connection_pool.connection_kwargs["password"] == SECRET
    assert "password" not in sync_client("redis://h/0", environ={}).connection_pool.connection_kwargs
    client = async_client("redis+sentinel://s1,s2/mymaster/1", environ=env, pool_timeout_s=3.0)
    pool = client.connection_pool
    assert isinstance(pool, aiosentinel.SentinelConnectionPool) and pool.timeout == 3.0  # a blocking pool
    assert pool.connection_kwargs["password"] == "from-env" and pool.connection_kwargs["db"] == 1
    pool = sync_client(f"redis+sentinel://:{SECRET}@s1/mymaster", environ=env).connection_pool
    assert isinstance(pool, sentinel.SentinelConnectionPool) and pool.connection_kwargs["password"] == SECRET


@pytest.mark.stack
@pytest.mark.skipif(DriverInfo is None, reason="redis-py < 7.2 reads its version once, at import")
def test_new_connections_do_not_read_the_package_metadata(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """redis-py >= 7.2 reads its version from the package metadata for each new connection (a
    gateway's first burst opens dozens) unless the client gives it: ours give it once."""
    import redis.utils

    url, proc = find_redis(tmp_path)
    reads: list[int] = []
    monkeypatch.setattr(redis.utils, "get_lib_version", lambda: reads.append(1) or redis.__version__)
    try:
        client = sync_client(url)
        conns = [client.connection_pool.get_connection() for _ in range(3)]  # three new connections
        for conn in conns:
            client.connection_pool.release(conn)
        assert client.ping() and reads == []
        info = client.client_info()
        assert info.get("lib-ver", redis.__version__) == redis.__version__  # CLIENT SETINFO still says it (Redis >= 7.2)
        client.close()
    finally:
        if proc is not None:
            proc.terminate()


def test_redaction_of_sentinel_urls() -> None:
    url = f"redis+sentinel://:{SECRET}@s1:26379,s2:26379/mymaster/0?sentinel_password={SECRET}x"
    assert SECRET not in redact_url(url)


@pytest.mark.stack
def test_logs_never_show_the_environment_password() -> None:
    code = (
        "import logging; from common.service_cli import setup_logging\n"
        "setup_logging('INFO')\n"
        "logging.getLogger('x').warning('AUTH failed for %s', 'env-secret-42')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), PASSWORD_ENV: "env-secret-42"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "AUTH failed for ***" in out.stderr and "env-secret-42" not in out.stderr, out.stderr
