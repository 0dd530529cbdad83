"""`Transport.send_many`: many appends as one script call on a real Redis, the pipeline where the
server runs no scripts (fakeredis here), the same effect either way."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import fakeredis
import pytest
import redis.asyncio as aioredis

from common.protocol import ENTRY_FIELD, Names
from common.transport import Outgoing, Transport, renewed_ttl_ms
from infra.stack import find_redis

pytestmark = pytest.mark.stack


def _sends(prefix: str) -> list[Outgoing]:
    return [
        Outgoing(f"{prefix}:a", b"a1", None, 60_000),
        Outgoing(f"{prefix}:b", b"b1", 5, None),
        Outgoing(f"{prefix}:a", b"a2", None, 60_000),
        *(Outgoing(f"{prefix}:b", f"b{i}".encode(), 5, None) for i in range(2, 400)),
    ]


async def _check(t: Transport, prefix: str) -> None:
    await t.send_many(_sends(prefix))
    r = t.redis
    assert [fields[ENTRY_FIELD] for _, fields in await r.xrange(f"{prefix}:a")] == [b"a1", b"a2"]
    assert 60_000 < await r.pttl(f"{prefix}:a") <= renewed_ttl_ms(60_000)
    assert await r.pttl(f"{prefix}:b") == -1  # no TTL asked for
    tail = [fields[ENTRY_FIELD] for _, fields in await r.xrange(f"{prefix}:b")]
    # Trimmed to about 5 (whole radix nodes), in order, ending with the last append.
    assert 5 <= len(tail) < 399 and tail[-1] == b"b399"
    assert tail == [f"b{i}".encode() for i in range(400 - len(tail), 400)]
    await t.send_many([Outgoing(f"{prefix}:a", b"a3")])  # one append: no script needed
    assert len(await r.xrange(f"{prefix}:a")) == 3


def test_appends_as_one_script_on_redis(tmp_path: Path) -> None:
    url, proc = find_redis(tmp_path)

    async def run() -> None:
        t = Transport(url, Names("t-batch"), owner="test")
        prefix = f"t-batch:{uuid.uuid4().hex[:8]}"
        try:
            await _check(t, prefix)
            assert t._append_script not in (None, False)  # the script path ran
            await t.redis.script_flush()  # as after a restart or failover: redis-py loads it again
            await t.send_many(_sends(prefix + "x"))
            assert len(await t.redis.xrange(prefix + "x:a")) == 2
        finally:
            await t.redis.delete(f"{prefix}:a", f"{prefix}:b", f"{prefix}x:a", f"{prefix}x:b")
            await t.close()

    try:
        asyncio.run(run())
    finally:
        if proc is not None:
            proc.terminate()


def test_appends_pipelined_where_scripts_are_refused() -> None:
    async def run() -> None:
        t = Transport("redis://unused", Names("t-batch"), owner="test")
        t.redis = fakeredis.FakeAsyncRedis()  # no Lua in this stand-in
        await _check(t, "t-batch:fake")
        assert t._append_script is False

    asyncio.run(run())


def test_script_refused_by_acl_falls_back(tmp_path: Path) -> None:
    url, proc = find_redis(tmp_path)

    async def run() -> None:
        admin = aioredis.Redis.from_url(url)
        user, password = f"noscript-{uuid.uuid4().hex[:6]}", "pw"
        await admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all", "-@scripting"])
        host_port = url.split("://", 1)[1]
        t = Transport(f"redis://{user}:{password}@{host_port}", Names("t-batch"), owner="test")
        prefix = f"t-batch:{uuid.uuid4().hex[:8]}"
        try:
            await _check(t, prefix)
            assert t._append_script is False
        finally:
            await admin.delete(f"{prefix}:a", f"{prefix}:b")
            await admin.acl_deluser(user)
            await t.close()
            await admin.aclose()

    try:
        asyncio.run(run())
    finally:
        if proc is not None:
            proc.terminate()
