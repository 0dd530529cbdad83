"""``rediss://`` for real: a redis-server on TLS only, with a throwaway CA, client certificates
required and a password read from ``CONVEYOR_REDIS_PASSWORD_FILE``. Both transport faces and a
whole stack (gateway, scheduler, executor) work over it; a client without TLS or without a
certificate does not get in."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from common.protocol import AbortRequests, Names
from common.redis_url import PASSWORD_FILE_ENV, sync_client
from common.transport import Outgoing, SyncTransport, Transport
from infra.stack import Stack
from tests.redis_servers import start_tls_redis

pytestmark = pytest.mark.stack

PASSWORD = "tls-test-secret"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, Path]]]:
    workdir = tmp_path_factory.mktemp("tlsredis")
    proc, port, certs = start_tls_redis(workdir, PASSWORD)
    (workdir / "password").write_text(PASSWORD + "\n")
    certs["password"] = workdir / "password"
    yield port, certs
    proc.kill()
    proc.wait()


def _url(port: int, certs: dict[str, Path], client_cert: bool = True) -> str:
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca']}&ssl_cert_reqs=required"
    return url + (f"&ssl_certfile={certs['client']}&ssl_keyfile={certs['client_key']}" if client_cert else "")


@pytest.fixture()
def password_file(tls_redis: tuple[int, dict[str, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tls_redis[1]["password"]))


@pytest.mark.usefixtures("password_file")
def test_both_transport_faces_over_tls(tls_redis: tuple[int, dict[str, Path]]) -> None:
    url = _url(*tls_redis)
    names = Names("tls-faces")
    stream = names.requests("0")
    sync = SyncTransport(url, names, owner="test")
    try:
        sync.exchange([Outgoing(stream, sync.encode(AbortRequests(["a"])))])
        [(got_stream, sent, msg)] = sync.read({stream: "0-0"}, block_ms=None)
        assert (got_stream, msg) == (stream, AbortRequests(["a"]))
        assert sync.run_id()

        async def run() -> list[Any]:
            t = Transport(url, names, owner="test")
            try:
                await t.send(stream, AbortRequests(["b"]))
                return [m for _, _, m in await t.read({stream: sent}, block_ms=None)]
            finally:
                await t.close()

        assert asyncio.run(run()) == [AbortRequests(["b"])]
    finally:
        sync.redis.delete(stream)
        sync.close()


@pytest.mark.usefixtures("password_file")
def test_tls_is_enforced(tls_redis: tuple[int, dict[str, Path]]) -> None:
    port, certs = tls_redis
    with pytest.raises(redis.ConnectionError):
        sync_client(f"redis://127.0.0.1:{port}/0", socket_timeout=2).ping()  # plain text to a TLS port
    with pytest.raises((redis.ConnectionError, OSError)):
        sync_client(_url(port, certs, client_cert=False), socket_timeout=2).ping()  # no client certificate
    assert sync_client(_url(port, certs)).ping()


def test_wrong_password_from_file_is_refused(tls_redis: tuple[int, dict[str, Path]], tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    with pytest.raises(redis.AuthenticationError):
        sync_client(_url(*tls_redis), environ={PASSWORD_FILE_ENV: str(wrong)}).ping()


@pytest.mark.usefixtures("password_file")
def test_stack_serves_over_tls(tls_redis: tuple[int, dict[str, Path]], tiny_model: Any, tmp_path: Path) -> None:
    stack = Stack(tiny_model(), tmp_path, redis_url=_url(*tls_redis))
    stack.start()
    try:
        client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None and r.usage.completion_tokens == 8
        chunks = list(client.completions.create(model="", prompt="x", max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
    finally:
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        stack.stop()
    assert PASSWORD not in logs
