"""Redis Cluster: a real cluster on localhost (three masters, a replica each, ``redis-cli --cluster
create``) under a ``redis+cluster://`` URL. The transports' multi-key calls stay in one slot each
(appends grouped by slot, one engine's streams read together), the run_id digest moves when a
replica takes over, a stack serves the OpenAI API on it, and the master holding an engine's streams
SIGKILLed mid-load loses no request: every one completes with its full token count and the same
text as before the fault (a 503 before a request was taken, retried, is the only error allowed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest

from common.protocol import Names
from common.transport import Outgoing, SyncTransport, Transport, by_slot, renewed_ttl_ms
from infra.stack import Stack
from tests.redis_servers import ClusterServers
from tests.test_redis_sentinel import AFTER_FAILOVER, MAX_TOKENS, NUM_CLIENTS, _one, run_clients_through_failover

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def _start(workdir: Path) -> ClusterServers:
    workdir.mkdir()
    servers = ClusterServers(workdir)
    try:
        return servers.start()
    except BaseException:
        servers.stop()
        raise


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServers]:
    """A cluster for the tests that kill nothing."""
    servers = _start(tmp_path_factory.mktemp("cluster") / "nodes")
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture()
def own_cluster(tmp_path: Path) -> Iterator[ClusterServers]:
    """A cluster of the test's own, for one whose master it kills."""
    servers = _start(tmp_path / "nodes")
    try:
        yield servers
    finally:
        servers.stop()


def test_names_keep_an_owners_keys_in_one_slot(shared_cluster: ClusterServers) -> None:
    names = Names("test-slots")
    t = SyncTransport(shared_cluster.url, names, owner="test")
    try:
        r: Any = t.redis
        engine = {r.keyslot(k) for k in (names.requests("e1"), names.engine("e1"), names.steps("e1"), names.results("e1"))}
        response = {r.keyslot(k) for k in (names.journal("x"), names.response("x"), names.response_events("x"))}
        assert len(engine) == 1 and len(response) == 1
        gateway = {r.keyslot(names.outputs("g")), r.keyslot(names.heartbeat("gateway", "g"))}
        assert len(gateway) == 1
        # Different owners spread over the masters.
        assert len({shared_cluster.master_of(names.journal(f"r{i}")) for i in range(32)}) == 3
        assert names.is_journal(names.journal("x")) and not names.is_journal(names.outputs("x"))
    finally:
        t.close()


def test_appends_across_slots_and_reads_of_one_engine(shared_cluster: ClusterServers) -> None:
    names = Names("test-appends")
    sends = [Outgoing(names.journal(f"r{i}"), f"j{i}".encode(), None, 60_000) for i in range(12)]
    sends += [Outgoing(names.requests("e1"), b"req", None, 60_000), Outgoing(names.outputs("g1"), b"out", 10, 60_000)]
    sync = SyncTransport(shared_cluster.url, names, owner="test")
    try:
        assert len(by_slot(sync.redis, sends)) == len(sends)  # one script call per slot

        async def send() -> str:
            t = Transport(shared_cluster.url, names, owner="test")
            try:
                await t.send_many(sends)
                await t.send_many(sends[:1])
                return await t.run_id()
            finally:
                await t.close()

        async_run_id = asyncio.run(send())
        r: Any = sync.redis
        assert [r.xlen(names.journal(f"r{i}")) for i in range(12)] == [2] + [1] * 11
        assert 0 < r.pttl(names.journal("r5")) <= renewed_ttl_ms(60_000)  # renewed past the TTL asked for
        # One XREAD over two streams of one engine, pipelined with appends to other slots.
        sync.exchange([Outgoing(names.steps("e1"), b"step", None, None)], None)
        cursors: dict[str, bytes | str] = {names.requests("e1"): "0-0", names.steps("e1"): "0-0"}
        raw = cast(Any, r).xread(cursors)
        assert sorted(len(entries) for _, entries in raw) == [1, 1]
        run_id = sync.run_id()
        assert len(run_id) == 40 and run_id == async_run_id  # a digest of the three masters' run_ids
    finally:
        for key in list(sync.redis.scan_iter(match="test-appends:*")):
            sync.redis.delete(key)
        sync.close()


def test_stack_serves_on_a_cluster(shared_cluster: ClusterServers, tiny_model: Any, tmp_path: Path) -> None:
    stack = Stack(tiny_model(), tmp_path, redis_url=shared_cluster.url, engines=2)
    stack.start()
    try:

        async def main() -> list[tuple[str, int]]:
            async with openai.AsyncOpenAI(base_url=f"{stack.urls[0]}/v1", api_key="x", max_retries=0, timeout=60) as client:
                return await asyncio.gather(*(_one(client, i, stream=i % 2 == 1) for i in range(8)))

        results = asyncio.run(main())
        assert all(tokens == MAX_TOKENS for _, tokens in results), results
        ids = [sid.decode() for sid in cast(list[bytes], stack.redis.zrange(stack.names.engines, 0, -1))]
        assert len(ids) == 2
    except BaseException:
        print(stack.logs(30))
        raise
    finally:
        stack.stop()


def test_engine_master_killed_under_load_loses_nothing(own_cluster: ClusterServers, tiny_model: Any, tmp_path: Path) -> None:
    stack = Stack(tiny_model(), tmp_path, redis_url=own_cluster.url, scheduler_args=("--recovery-timeout", "60"))
    stack.start()
    old_run_id = SyncTransport(own_cluster.url, stack.names, owner="test").run_id()
    sid = cast(list[bytes], stack.redis.zrange(stack.names.engines, 0, -1))[0].decode()
    victim = own_cluster.master_of(stack.names.requests(sid))  # the engine's streams, its status and heartbeat
    try:
        outcome, state, elapsed = run_clients_through_failover(
            stack.urls[0],
            lambda: own_cluster.kill(victim),
            lambda: own_cluster.master_of(stack.names.requests(sid)) != victim and own_cluster.serving(),
            own_cluster.logs,
        )
    except BaseException:
        print(stack.logs(30), own_cluster.logs(), sep="\n")
        raise
    finally:
        stack.stop()
    assert own_cluster.master_of(stack.names.requests(sid)) != victim
    new_run_id = SyncTransport(own_cluster.url, stack.names, owner="test").run_id()
    assert new_run_id != old_run_id, "the services notice a failover by the run_id digest changing"
    assert all(tokens == MAX_TOKENS for _, _, tokens in outcome.texts), outcome.texts
    by_prompt: dict[int, set[str]] = {}
    for prompt, text, _ in outcome.texts:
        by_prompt.setdefault(prompt, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values()), "a greedy request's text changed across the failover"
    assert outcome.started_before_kill > 0, "no request was in flight when the master died"
    assert len(outcome.texts) >= NUM_CLIENTS * (2 + AFTER_FAILOVER)
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("*.log"))
    assert "Redis restarted" in logs, "the services did not notice the failover"
    print(
        f"cluster failover: {len(outcome.texts)} requests completed in {elapsed:.1f} s, "
        f"{outcome.started_before_kill} in flight at the kill (longest {outcome.longest_s:.1f} s), replica promoted "
        f"{state['promoted_after_s']:.1f} s after the kill, {outcome.refused} refused (503) and retried"
    )


def test_appends_to_many_slots_share_connections(shared_cluster: ClusterServers) -> None:
    """A gateway's read journals one entry to each of many responses' journals (a slot each): they
    go as one cluster pipeline, a round trip per master on the connections it has, not as a call,
    a connection and a round trip per journal."""
    names = Names("test-fanout")
    nodes = [shared_cluster.client(port) for port in shared_cluster.live_ports()]  # connected once: not counted twice

    def opened() -> int:
        return sum(int(node.info("stats")["total_connections_received"]) for node in nodes)

    async def send() -> int:
        t = Transport(shared_cluster.url, names, owner="test")
        try:
            sends = [Outgoing(names.journal(f"r{i}"), b"entry", None, 60_000) for i in range(64)]
            await t.send_many(sends)  # connects to every master
            before = opened()
            for _ in range(4):
                await t.send_many(sends)
            return opened() - before
        finally:
            await t.close()

    sync = SyncTransport(shared_cluster.url, names, owner="test")
    try:
        new_connections = asyncio.run(send())
        r: Any = sync.redis
        assert [r.xlen(names.journal(f"r{i}")) for i in range(64)] == [5] * 64
        assert 0 < r.pttl(names.journal("r7")) <= renewed_ttl_ms(60_000)
        assert new_connections == 0, f"{new_connections} connections opened for 4 reads' appends"
    finally:
        for key in list(sync.redis.scan_iter(match="test-fanout:*")):
            sync.redis.delete(key)
        sync.close()
