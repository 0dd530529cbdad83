"""KV-cache groups of hybrid models in the cache manager, the scheduler and the executor's batch
(no model): one pool, one table per group, window groups free what their window left, the full
group keeps every block, and a prefix hit is the longest length every group serves."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from common.config import SchedulerConfig
from common.sampling_params import SamplingParams
from executor.input_batch import Batch, PersistentBatch
from executor.kv_groups import kv_group_layout
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.kv_groups import HybridCacheManager, cache_manager_for
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.test_scheduler import VOCAB, ScriptedExecutor, expected_output, step

pytestmark = pytest.mark.unit


@dataclass
class LayerTypes:
    """The part of `HFModelConfig` the layout reads."""

    windows: list[int | None]

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    def window(self, layer: int) -> int | None:
        return self.windows[layer]


def test_layers_group_by_type_in_groups_of_equal_size() -> None:
    gemma3 = kv_group_layout(LayerTypes([8, 8, 8, 8, 8, None] * 2))  # type: ignore[arg-type]
    assert gemma3 is not None
    assert gemma3.windows == [None, 8, 8, 8, 8, 8] and gemma3.num_slots == 2  # 2 full layers: groups of 2
    assert gemma3.groups[0] == [5, 11] and gemma3.groups[1] == [0, 1] and gemma3.groups[5] == [9, 10]
    assert gemma3.layer_group[11] == 0 and gemma3.layer_slot[11] == 1
    alternating = kv_group_layout(LayerTypes([4, None, 4, None]))  # type: ignore[arg-type]
    assert alternating is not None
    assert alternating.groups == [[1, 3], [0, 2]] and alternating.windows == [None, 4]
    assert alternating.layer_group == [1, 0, 1, 0] and alternating.layer_slot == [0, 0, 1, 1]
    assert kv_group_layout(LayerTypes([4, 4, 4])) is None  # type: ignore[arg-type]
    assert kv_group_layout(LayerTypes([None, None])) is None  # type: ignore[arg-type]


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


def test_window_groups_free_and_the_full_group_keeps_every_block() -> None:
    cm = HybridCacheManager(32, 4, [None, 6])
    null = cm.null_block
    assert cm.allocate_slots("a", 20, (), 0)  # 5 blocks in each group
    assert cm.get_num_free_blocks() == 22
    assert cm.allocate_slots("a", 22, (), 13)  # the window group frees its blocks 0 and 1
    table = cm.get_block_table("a")
    full, window = table[0::2], table[1::2]
    assert len(full) == len(window) == 6 and null not in full
    assert window[:2] == [null, null] and null not in window[2:]
    assert cm.num_skipped("a") == 2 and cm.get_num_free_blocks() == 32 - 12 + 2
    cm.check_invariants()
    cm.free("a")
    cm.check_invariants()
    assert cm.get_num_free_blocks() == 32


def test_allocation_is_all_or_nothing_across_groups() -> None:
    cm = HybridCacheManager(9, 4, [None, 4])
    assert cm.allocate_slots("a", 16)  # 4 + 4 of 9
    assert not cm.allocate_slots("b", 12)  # 3 + 3 > 1 free: neither group takes any
    assert cm.get_block_table("b") == [] and cm.get_num_free_blocks() == 1
    assert cm.blocks_short(12) == 5
    cm.check_invariants()


def test_a_hit_is_the_longest_prefix_every_group_serves() -> None:
    cm = HybridCacheManager(40, 2, [None, 3])  # the window group needs cdiv(2, 2) = 1 block
    a = req("a", list(range(1, 14)))  # 13 tokens: 6 full blocks
    assert cm.allocate_slots("a", 13)
    cm.cache_full_blocks(a, 12)
    a_table = cm.get_block_table("a")
    b = req("b", list(range(1, 14)) + [7])
    hit, tokens = cm.get_computed_blocks(b)
    null = cm.null_block
    assert tokens == 12 and hit[0::2] == a_table[0:12:2]  # the full group: every block
    assert hit[1::2] == [null] * 5 + [a_table[11]]  # the window group: what its window needs
    # The window group loses its block 5 (evicted): its hit moves to block 4 and so must the full group's.
    cm.free("a")
    cm.groups[1].drop_entry(a_table[11])
    hit, tokens = cm.get_computed_blocks(b)
    assert tokens == 10 and hit[0::2] == a_table[0:10:2] and hit[1::2] == [null] * 4 + [a_table[9]]
    assert cm.allocate_slots("b", 14, hit)
    assert cm.get_block_table("b")[1:10:2] == hit[1::2] and cm.num_skipped("b") == 4
    cm.check_invariants()
    # Groups key their entries apart: the same content is cached once per group.
    assert len({blk.block_hash for blk in cm.pool.blocks if blk.block_hash is not None}) == len(cm.pool.cached_blocks)


def test_the_batch_maps_each_group_to_its_own_slots() -> None:
    state = PersistentBatch(2, None, num_groups=2)
    from common.protocol import SchedulerOutput

    out = SchedulerOutput(step=1)
    out.add_new("r", SamplingParams(max_tokens=2), 3, [1, 2, 3], [10, 20, 11, 21])
    out.add_scheduled("r", 3, 0, True)
    batch = state.prepare(out)
    batch.check()
    assert batch.slot_mapping.tolist() == [20, 21, 22, 40, 41, 42]  # group 0's rows, then group 1's


class HybridExecutor(ScriptedExecutor):
    """A scripted executor with one full and one window group: each group's K/V is written to
    its own blocks and must be read back whole over what each layer type sees; nothing is
    written into the null block."""

    def __init__(self, num_blocks: int, block_size: int, window: int, max_model_len: int = 64) -> None:
        super().__init__(num_blocks, block_size, max_model_len)
        self.info.kv_group_windows = [0, window]
        self.state = PersistentBatch(block_size, VOCAB, num_groups=2)
        self.window = window
        self.kv: dict[int, tuple[int, ...]] = {}

    def run_batch(self, batch: Batch) -> list[int]:
        bs, null, w = self.info.block_size, self.info.num_blocks, self.window
        rows = list(zip(batch.request_ids, batch.seq_lens, batch.query_lens, batch.block_tables))
        for rid, end, q, table in rows:
            tokens = self.state.requests[rid].token_ids
            for g in range(2):
                t = table[g::2]
                for p in range(end - q, end):
                    assert t[p // bs] != null, f"{rid} writes position {p} of group {g} into the null block"
                    self.kv[t[p // bs] * bs + p % bs] = (g, *tokens[: p + 1])
        for rid, end, q, table in rows:
            tokens = self.state.requests[rid].token_ids
            for g, first in ((0, 0), (1, max(0, end - q - w + 1))):
                t = table[g::2]
                for p in range(first, end):
                    assert self.kv.get(t[p // bs] * bs + p % bs) == (g, *tokens[: p + 1]), (
                        f"{rid} reads stale K/V of group {g} at position {p} ({table})"
                    )
        return super().run_batch(batch)


def test_random_hybrid_workloads_keep_their_kv_and_outputs() -> None:
    """Random shared prefixes, windows, small pools (preemption and hits), steps in flight:
    every group reads its own K/V, outputs equal running alone, and the pool ends whole."""
    for seed in range(100):
        try:
            hybrid_workload(seed)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc


def hybrid_workload(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    window = rng.choice([1, 2, 3, 5, 8])
    num_blocks = 2 * -(-64 // block_size) + rng.randint(0, 6)
    depth = rng.choice([1, 2, 3])
    config = SchedulerConfig(
        rng.choice([3, 5, 8, 16]),
        rng.choice([2, 4, 8]),
        enable_prefix_caching=rng.random() < 0.8,
        free_window_blocks=rng.random() < 0.8,
    )
    ex = HybridExecutor(num_blocks, block_size, window)
    cache = cache_manager_for(ex.info, config)
    assert isinstance(cache, HybridCacheManager)
    sched = Scheduler(config, cache, ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=depth > 1, steps_in_flight=max(depth, 2))
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(4, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
        requests.append(Request(str(i), prompt, params))
    pending = list(requests)
    got: dict[str, list[int]] = {}
    while pending or core.has_work():
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if core.has_work():
            step(core, got)
    for r in requests:
        assert got.get(r.request_id) == expected_output(r.prompt_token_ids, r.sampling_params), r.request_id
    sched.cache.check_invariants()
    assert sched.cache.get_num_free_blocks() == num_blocks and not sched.requests and not sched.pending
