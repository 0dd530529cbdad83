"""Routing by cached prefix: the engines' summaries of their prefix caches (bounded, kept as
entries come and go, hashed as a gateway hashes a prompt), the gateway's index of them, and
Dynamo's KV router cost."""

from __future__ import annotations

import dataclasses

import pytest

from common.prefix_hash import SUMMARY_KEY_BYTES, decode_summary, iter_block_hashes, summary_key
from common.protocol import EngineStatus, decode, encode
from common.sampling_params import SamplingParams
from gateway.engine.prefix_index import PrefixIndex
from gateway.engine.routing import active_blocks, choose_engine, routing_cost
from gateway.http.config import GatewayConfig
from scheduler.cache_manager import CacheManager
from scheduler.kv_groups import HybridCacheManager
from scheduler.prefix_summary import SUMMARY_MAX_KEYS, PrefixSummary
from scheduler.request import Request
from tests.test_engine_client import SAMPLING, async_test, engine, make_client, publish

pytestmark = pytest.mark.unit

BS = 4


def request(rid: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), cache_salt=cache_salt)


def computed(cm: CacheManager | HybridCacheManager, req: Request) -> None:
    """Admit ``req`` with its hit and register its prompt's full blocks, as a finished prefill does."""
    hit, _ = cm.get_computed_blocks(req)
    assert cm.allocate_slots(req.request_id, req.num_tokens, hit)
    cm.cache_full_blocks(req, req.num_tokens)


# -- the engine's summary --------------------------------------------------------------------------
def test_summary_is_bounded_newest_first_and_counts_shared_keys() -> None:
    s = PrefixSummary()
    keys = [i.to_bytes(16, "little") for i in range(SUMMARY_MAX_KEYS + 500)]
    for k in keys:
        s.added(k)
    packed = s.encode()
    assert len(packed) == SUMMARY_MAX_KEYS * SUMMARY_KEY_BYTES <= 32 * 1024
    assert packed[:SUMMARY_KEY_BYTES] == summary_key(keys[-1])  # newest first
    assert summary_key(keys[0]) not in decode_summary(packed)  # the oldest fell off
    s.used([keys[0]])  # a hit makes it the newest again
    assert decode_summary(s.encode(1)) == {summary_key(keys[0])}
    # Two entries with one key (two KV-cache groups' of one block): it stays until both are gone.
    s.added(keys[1])
    s.removed(keys[1])
    assert summary_key(keys[1]) in s.counts()
    s.removed(keys[1])
    assert summary_key(keys[1]) not in s.counts()
    # Its place in a status key: bounded however large the pool.
    status = dataclasses.replace(engine("e"), cached_prefixes=packed)
    assert len(encode(status)) - len(encode(engine("e"))) <= 32 * 1024 + 8
    assert decode(encode(status), (EngineStatus,)).cached_prefixes == packed


def test_cache_manager_keeps_its_summary_and_a_gateway_hashes_alike() -> None:
    cm = CacheManager(8, BS)
    a = request("a", list(range(1, 14)))  # 3 full blocks
    computed(cm, a)
    cm.check_invariants()  # the summary agrees with the cache, entry for entry
    gateway_keys = [summary_key(h) for h in iter_block_hashes(a.prompt_token_ids, BS)]
    assert decode_summary(cm.summary.encode()) == set(gateway_keys)
    # A salted request's blocks match only the same salt's hashes.
    salted = request("s", [50, 51, 52, 53, 54], cache_salt="t1")
    computed(cm, salted)
    assert summary_key(next(iter_block_hashes(salted.prompt_token_ids, BS, "t1"))) in cm.summary.counts()
    assert summary_key(next(iter_block_hashes(salted.prompt_token_ids, BS))) not in cm.summary.counts()
    # Evictions leave the summary as they leave the cache.
    cm.free("a")
    cm.free("s")
    assert cm.allocate_slots("big", 8 * BS)
    cm.check_invariants()
    assert len(cm.summary) == 0 and cm.summary.encode() == b""
    cm.free("big")
    computed(cm, a)
    cm.reset_prefix_cache()
    assert cm.summary.encode() == b""


def test_hybrid_groups_share_one_summary() -> None:
    cm = HybridCacheManager(16, BS, [None, 8])
    a = request("a", list(range(1, 14)))
    computed(cm, a)
    cm.check_invariants()
    assert decode_summary(cm.summary.encode()) == {summary_key(h) for h in iter_block_hashes(a.prompt_token_ids, BS)}
    assert set(cm.summary.counts().values()) == {2}  # one entry per group, one key


# -- the gateway's index ---------------------------------------------------------------------------
def test_index_overlap_is_the_deepest_block_held_and_routed_prompts_expire() -> None:
    prompt = list(range(100, 140))  # 10 blocks
    hashes = list(iter_block_hashes(prompt, BS))
    held = PrefixSummary()
    for h in hashes[:6]:
        held.added(h)
    index = PrefixIndex(ttl_s=10, max_routed_keys=5)
    index.update({"e": dataclasses.replace(engine("e"), cached_prefixes=held.encode(3))})  # only 3 newest keys
    assert index.overlap("e", hashes) == 6  # blocks 3-5 published: the prefix through block 5
    assert index.overlap("e", list(iter_block_hashes(list(range(40)), BS))) == 0
    assert index.overlap("other", hashes) == 0
    index.remember("f", hashes, now=0.0)
    assert index.overlap("f", hashes, now=1.0) == 10
    assert index.num_keys("f") == (0, 5)  # bounded: the deepest keys kept
    assert index.overlap("f", hashes[:4], now=1.0) == 0  # a shorter prompt's blocks were dropped
    assert index.overlap("f", hashes, now=11.0) == 0 and index.num_keys("f") == (0, 0)  # expired
    index.update({"f": engine("f")})  # "e" is gone
    assert index.overlap("e", hashes) == 0


# -- the cost --------------------------------------------------------------------------------------
def test_cost_weighs_blocks_to_prefill_against_blocks_in_use() -> None:
    assert routing_cost(prompt_blocks=10, overlap=6, active=20, overlap_weight=1.0) == 24
    assert routing_cost(prompt_blocks=10, overlap=6, active=20, overlap_weight=2.0) == 28
    busy = engine("b", running=2, free=60)  # 40 blocks in use, 20 a request
    assert active_blocks(busy, sent_blocks=0, prompt_blocks=5) == 40
    assert active_blocks(dataclasses.replace(busy, num_waiting=1), sent_blocks=3, prompt_blocks=5) == 63
    idle_waiting = engine("w", waiting=2)
    assert active_blocks(idle_waiting, sent_blocks=0, prompt_blocks=5) == 10  # no running mean: the prompt's size
    cached, idle = engine("cached", running=1, free=70), engine("idle")  # 30 blocks in use vs none
    prompt = list(range(16 * 40))  # 40 blocks

    def pick(overlap: int, weight: float) -> str:
        chosen = choose_engine(
            [cached, idle],
            lambda e: e.load,
            prompt,
            overlap_of=lambda e: overlap if e is cached else 0,
            overlap_weight=weight,
        )
        assert chosen is not None
        return chosen.scheduler_id

    assert pick(overlap=31, weight=1.0) == "cached"  # 9 + 30 < 40 + 0
    assert pick(overlap=29, weight=1.0) == "idle"  # 11 + 30 > 40
    assert pick(overlap=20, weight=2.0) == "cached"  # 40 + 30 < 80
    assert pick(overlap=40, weight=0.0) == "idle"  # no weight: load alone


def test_routing_policies_are_validated() -> None:
    assert GatewayConfig().routing == "cache_aware"
    with pytest.raises(ValueError, match="routing must be one of"):
        GatewayConfig(routing="random")
    with pytest.raises(ValueError, match="overlap_weight"):
        GatewayConfig(routing_overlap_weight=-1)


# -- the gateway routing ---------------------------------------------------------------------------
@async_test
async def test_cache_aware_gateway_follows_summaries_and_its_own_recent_routes() -> None:
    client = make_client()
    history = list(range(1000, 1000 + 16 * 8))  # 8 blocks of block_size 16
    held = PrefixSummary()
    for h in iter_block_hashes(history, 16):
        held.added(h)
    await publish(client, engine("a"), dataclasses.replace(engine("b"), cached_prefixes=held.encode()), engine("c"))
    assert client.pick_engine(history + [1, 2, 3]).scheduler_id == "b"
    # A new conversation: nowhere cached, so it goes by load; its next turn follows it before any summary says so.
    first = await client.submit("t1", list(range(16 * 6)), SAMPLING)
    second = await client.submit("t2", list(range(16 * 6)) + list(range(500, 520)), SAMPLING)
    assert second.scheduler_id == first.scheduler_id
    # Prompts sharing nothing spread (each one's blocks count as load where it went).
    spread = {(await client.submit(f"u{i}", [i] * (16 * 6), SAMPLING)).scheduler_id for i in range(6)}
    assert len(spread) == 3
    # A prompt's n samples (siblings on the first one's engine) count its new blocks once.
    before = dict(client.sent_blocks_since_refresh)
    lead = await client.submit("n0", list(range(2000, 2000 + 16 * 5)), SAMPLING)
    for i in (1, 2, 3):
        await client.submit(f"n{i}", list(range(2000, 2000 + 16 * 5)), SAMPLING, group_id="g", prefer_engine=lead.scheduler_id)
    sid = lead.scheduler_id
    assert client.sent_blocks_since_refresh[sid] - before.get(sid, 0) == 5
    # Every policy routes a prompt under one block by load alone.
    for policy in ("cache_aware", "first_block", "least_loaded"):
        other = make_client(routing=policy)
        await publish(other, engine("x", running=3), engine("y"))
        assert other.pick_engine([1, 2]).scheduler_id == "y"
