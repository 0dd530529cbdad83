"""Sliding-window KV memory in the cache manager and the scheduler (no model).

With one window W for every layer, a request keeps only the blocks its next tokens can still see:
blocks wholly before ``num_computed_tokens - W + 1`` go back to the pool (keeping their prefix-cache
entries) and the null block (id ``num_blocks``) takes their place in its table, also in the
executor's copy; a prefix hit needs only its last cdiv(W - 1, block_size) blocks cached.
"""

from __future__ import annotations

import random

import pytest

from common.config import ExecutorInfo, SchedulerConfig
from common.sampling_params import SamplingParams
from executor.input_batch import Batch
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.kv_groups import cache_manager_for
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.test_scheduler import EOS, VOCAB, ScriptedExecutor, expected_output, step

pytestmark = pytest.mark.unit


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), cache_salt=salt)


def test_blocks_behind_the_window_are_freed_and_nulled() -> None:
    cm = CacheManager(16, 4, sliding_window=6)
    null = cm.null_block
    assert null == 16
    assert cm.allocate_slots("a", 20, (), 0)  # 5 blocks, nothing computed yet: nothing to free
    table = list(cm.get_block_table("a"))
    assert len(table) == 5 and null not in table and cm.get_num_free_blocks() == 11
    # 12 computed: the next token (position 12) sees 7..12, so blocks 0 (0-3) goes, block 1 (4-7) stays.
    assert cm.allocate_slots("a", 21, (), 12)
    assert cm.get_block_table("a")[:2] == [null, table[1]] and cm.num_skipped("a") == 1
    assert cm.get_num_free_blocks() == 16 - 6 + 1
    # 13 computed: position 13 sees 8..13: block 1 goes too; the new token's block is allocated.
    assert cm.allocate_slots("a", 22, (), 13)
    assert cm.get_block_table("a")[:3] == [null, null, table[2]] and cm.num_skipped("a") == 2
    cm.check_invariants()
    cm.free("a")
    cm.check_invariants()
    assert cm.get_num_free_blocks() == 16


def test_freed_window_blocks_stay_prefix_cache_hits_until_evicted() -> None:
    cm = CacheManager(8, 4, sliding_window=5)
    a = req("a", list(range(1, 18)))  # 17 tokens: 4 full blocks
    assert cm.allocate_slots("a", 17)
    cm.cache_full_blocks(a, 16)
    full = list(cm.get_block_table("a"))
    assert cm.allocate_slots("a", 17, (), 16)  # position 16 sees 12..16: blocks 0-2 freed
    assert cm.num_skipped("a") == 3 and cm.get_num_free_blocks() == 8 - 5 + 3
    # A second request with the same 16 leading tokens: a hit of all 4 blocks needs only the last
    # cdiv(W - 1, 4) = 1 of them; the 3 before come back as null blocks.
    b = req("b", list(range(1, 18)) + [99])
    hit, tokens = cm.get_computed_blocks(b)
    assert tokens == 16 and hit == [cm.null_block] * 3 + [full[3]]
    assert cm.allocate_slots("b", 18, hit)
    assert cm.get_block_table("b")[:4] == hit and cm.num_skipped("b") == 3
    cm.check_invariants()
    # Evicting the freed blocks never shortens a window hit: only the tail is needed.
    cm.free("a")
    cm.free("b")
    assert cm.allocate_slots("x", 4 * 5)  # takes 5 of 8: the 3 freed head blocks first (LRU)
    hit, tokens = cm.get_computed_blocks(req("c", list(range(1, 18))))
    assert tokens == 16 and hit[-1] == full[3]
    cm.check_invariants()


def test_a_window_hit_needs_a_contiguous_tail() -> None:
    cm = CacheManager(16, 2, sliding_window=5)  # needs cdiv(4, 2) = 2 contiguous blocks
    a = req("a", list(range(1, 14)))  # 13 tokens: 6 full blocks
    assert cm.allocate_slots("a", 13)
    cm.cache_full_blocks(a, 12)
    table = cm.get_block_table("a")
    # Drop the cache entry of block 4: the furthest run of 2 cached blocks is then blocks 2-3.
    cm.drop_entry(table[4])
    hit, tokens = cm.get_computed_blocks(req("b", list(range(1, 14))))
    assert tokens == 8 and hit == [cm.null_block] * 2 + table[2:4]
    for gone, want in ((2, table[:2]), (1, table[:1])):
        # Without block 2, the only run of 2 is blocks 0-1; without block 1 too, block 0 alone:
        # a hit from the start, shorter than the window.
        cm.drop_entry(table[gone])
        hit, tokens = cm.get_computed_blocks(req("c", list(range(1, 14))))
        assert hit == want and tokens == 2 * len(want)


def test_a_block_nulled_before_its_step_answered_is_not_registered() -> None:
    cm = CacheManager(8, 4, sliding_window=2)
    a = req("a", list(range(1, 30)))
    assert cm.allocate_slots("a", 16)
    assert cm.allocate_slots("a", 24, (), 16)  # the next chunk is scheduled before the first answered
    assert cm.num_skipped("a") == 3
    cm.cache_full_blocks(a, 24)  # blocks 0-2 were nulled: only blocks 3-5 can be registered
    assert len(cm.cached_blocks) == 3
    cm.check_invariants()


def test_waiting_for_the_cache_keeps_a_block_until_it_is_registered() -> None:
    cm = CacheManager(8, 4, sliding_window=2, wait_for_cache=True)
    a = req("a", list(range(1, 30)))
    assert cm.allocate_slots("a", 16)
    assert cm.allocate_slots("a", 24, (), 16)  # the first chunk has not answered: nothing registered
    assert cm.num_skipped("a") == 0
    cm.cache_full_blocks(a, 16)  # it answered: its 4 blocks are cache entries, then free to go
    assert cm.allocate_slots("a", 28, (), 24)
    assert cm.num_skipped("a") == 4 and len(cm.cached_blocks) == 4
    cm.check_invariants()


def test_without_a_window_block_tables_are_unchanged() -> None:
    cm = CacheManager(8, 4)
    assert cm.allocate_slots("a", 20, (), 0) and cm.allocate_slots("a", 24, (), 20)
    assert cm.num_skipped("a") == 0 and cm.null_block not in cm.get_block_table("a")


@pytest.mark.parametrize("free", [True, False])
def test_the_switch_and_the_executor_say_whether_to_free(free: bool) -> None:
    info = ExecutorInfo("m", 10, 4, 64, [EOS], VOCAB, sliding_window=8)
    assert cache_manager_for(info, SchedulerConfig(free_window_blocks=free)).sliding_window == (8 if free else None)
    assert not cache_manager_for(info, SchedulerConfig(enable_prefix_caching=False)).wait_for_cache
    plain = ExecutorInfo("m", 10, 4, 64, [EOS], VOCAB)
    assert cache_manager_for(plain, SchedulerConfig()).sliding_window is None


class WindowKVExecutor(ScriptedExecutor):
    """Writes a record of each position's token prefix into its KV slot, as a forward pass writes
    K/V, and checks each row: every key its window sees holds the row's own prefix, null blocks
    only lead its table, and nothing is ever written into the null block. ``strict``: the
    scheduler frees at once (no prefix caching to wait for), so the blocks wholly behind the
    window must be null (it never reads freed memory)."""

    def __init__(self, num_blocks: int, block_size: int, window: int, max_model_len: int = 64, strict: bool = False) -> None:
        super().__init__(num_blocks, block_size, max_model_len)
        self.info.sliding_window = window
        self.strict = strict
        self.kv: dict[int, tuple[int, ...]] = {}
        self.nulls_read = 0

    def run_batch(self, batch: Batch) -> list[int]:
        bs, w, null = self.info.block_size, self.info.sliding_window, self.info.num_blocks
        assert w is not None
        for i, rid in enumerate(batch.request_ids):
            tokens, end, q, table = (
                self.state.requests[rid].token_ids,
                batch.seq_lens[i],
                batch.query_lens[i],
                batch.block_tables[i],
            )
            for p in range(end - q, end):
                assert table[p // bs] != null, f"{rid} writes position {p} into the null block"
                self.kv[table[p // bs] * bs + p % bs] = tuple(tokens[: p + 1])
        for i, rid in enumerate(batch.request_ids):
            tokens, end, q, table = (
                self.state.requests[rid].token_ids,
                batch.seq_lens[i],
                batch.query_lens[i],
                batch.block_tables[i],
            )
            first = max(0, end - q - w + 1)  # the first key its first new token sees
            behind = table[: first // bs] if self.strict else []
            assert all(b == null for b in behind), f"{rid}: a block behind its window is not null ({table})"
            nulls = sum(b == null for b in table)
            assert all(b == null for b in table[:nulls]), f"{rid}: a null block inside its window ({table})"
            self.nulls_read += nulls
            for p in range(first, end):
                assert self.kv.get(table[p // bs] * bs + p % bs) == tuple(tokens[: p + 1]), (
                    f"{rid} attends to stale K/V at position {p} (table {table})"
                )
        return super().run_batch(batch)


@pytest.mark.parametrize("caching", [True, False])
def test_the_executor_copy_of_a_table_gets_its_null_blocks(caching: bool) -> None:
    ex = WindowKVExecutor(32, 4, window=5, strict=not caching)
    config = SchedulerConfig(8, 4, enable_prefix_caching=caching)
    sched = Scheduler(config, cache_manager_for(ex.info, config), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=True)
    r = Request("r", list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(r)
    got: dict[str, list[int]] = {}
    while core.has_work():
        step(core, got)
    assert got["r"] == expected_output(r.prompt_token_ids, r.sampling_params)
    assert ex.nulls_read > 0
    assert any(any(o.cached_resumed) for o in ex.outputs), "a table with new null blocks is resent whole"


def test_freeing_lets_more_requests_run_at_once() -> None:
    """The same long requests in a small pool: with the window's blocks freed they all run side by
    side with no preemption; keeping every block, they preempt each other."""

    def preemptions(free: bool) -> int:
        ex = WindowKVExecutor(20, 4, window=4, max_model_len=80)
        config = SchedulerConfig(8, 8, free_window_blocks=free)
        sched = Scheduler(config, cache_manager_for(ex.info, config), ex.info)
        core = EngineCore(sched, InlineExecutor(ex), async_scheduling=True)
        requests = [
            Request(str(i), [i + 1] * 40 + list(range(1, 20)), SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(4)
        ]
        got: dict[str, list[int]] = {}
        for r in requests:
            sched.add_request(r)
        while core.has_work():
            step(core, got)
        for r in requests:
            assert got[r.request_id] == expected_output(r.prompt_token_ids, r.sampling_params, 80)
        return sched.num_preemptions

    assert preemptions(True) == 0
    assert preemptions(False) > 0


def test_random_windowed_workloads_keep_their_kv_and_outputs() -> None:
    """Random shared prefixes, windows, lengths, aborts, steps in flight and small pools
    (preemption and resume through window hits): every row reads only its own K/V in its window,
    outputs equal running alone, and the pool ends whole."""
    for seed in range(150):
        try:
            windowed_workload(seed)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc


def windowed_workload(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    window = rng.choice([1, 2, 3, 5, 8, 13])
    num_blocks = -(-30 // block_size) + rng.randint(0, 4)
    depth = rng.choice([1, 2, 3])
    config = SchedulerConfig(rng.choice([3, 5, 8, 16]), rng.choice([2, 4, 8]), enable_prefix_caching=rng.random() < 0.8)
    ex = WindowKVExecutor(num_blocks, block_size, window, strict=not config.enable_prefix_caching)
    sched = Scheduler(config, cache_manager_for(ex.info, config), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=depth > 1, steps_in_flight=max(depth, 2))
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(4, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
        requests.append(Request(str(i), prompt, params, cache_salt=rng.choice([None, None, "s1"])))
    pending = list(requests)
    aborted: set[str] = set()
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    while pending or core.has_work():
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        live = [r.request_id for r in requests if r.request_id in sched.requests]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            aborted.add(victim)
            assert sched.abort(victim) is not None
            finished[victim] = "abort"
        if core.has_work():
            step(core, got, finished)
    for r in requests:
        want = expected_output(r.prompt_token_ids, r.sampling_params)
        mine = got.get(r.request_id, [])
        assert (mine == want[: len(mine)]) if r.request_id in aborted else (mine == want), r.request_id
    sched.cache.check_invariants()
    assert sched.cache.get_num_free_blocks() == num_blocks and not sched.requests and not sched.pending


def test_random_cache_manager_sequences_match_a_simple_model() -> None:
    """Random admit (with window hits) / grow / preempt / finish sequences on the cache manager
    alone, against what a window keeps: each table is as long as its tokens need, its leading
    ``max(0, c - W + 1) // block_size`` entries are null (no more than are registered, when it waits
    for the cache) and the rest distinct live blocks, a hit
    names blocks cached under the request's own hashes and ends in the run the window needs,
    and the free count is the pool less the blocks some table holds."""
    for seed in range(100):
        rng = random.Random(seed)
        bs, window, total = rng.choice([2, 4]), rng.choice([1, 3, 4, 6, 9]), rng.randint(6, 20)
        wait = rng.random() < 0.5
        cm = CacheManager(total, bs, sliding_window=window, wait_for_cache=wait)
        registered: dict[str, int] = {}  # blocks registered per request (hits count as registered)
        needed = max(1, -(-(window - 1) // bs))
        base = [rng.randrange(1, 50) for _ in range(12)]
        live: dict[str, tuple[Request, int, int]] = {}  # id -> (request, computed, allocated tokens)
        for op in range(60):
            choice = rng.random()
            if choice < 0.3 or not live:
                rid = f"r{op}"
                r = req(rid, base[: rng.randint(1, 12)] + [rng.randrange(1, 50) for _ in range(rng.randint(0, 8))])
                hit, hit_tokens = cm.get_computed_blocks(r)
                if hit:
                    for j, b in enumerate(hit):
                        if b != cm.null_block:
                            assert cm.blocks[b].block_hash == r.block_hashes[j], f"seed {seed}: a hit of another prefix"
                    assert hit_tokens < r.num_tokens
                    assert all(b != cm.null_block for b in hit[-needed:]) or hit[0] != cm.null_block
                end = min(r.num_tokens, hit_tokens + rng.randint(1, 6))
                if cm.allocate_slots(rid, end, hit):
                    live[rid] = (r, hit_tokens, end)
                    registered[rid] = len(hit)
            elif choice < 0.8:
                rid = rng.choice(list(live))
                r, computed, allocated = live[rid]
                if rng.random() < 0.7:  # else its step has not answered yet
                    cm.cache_full_blocks(r, allocated)
                    registered[rid] = max(registered[rid], allocated // bs)
                computed = allocated
                end = min(computed + rng.randint(1, 5), r.num_tokens + 8)
                if end > r.num_tokens:
                    r.output_token_ids.extend(rng.randrange(1, 50) for _ in range(end - r.num_tokens))
                if cm.allocate_slots(rid, end, (), computed):
                    live[rid] = (r, computed, end)
                else:
                    live[rid] = (r, computed, computed)
            else:
                rid = rng.choice(list(live))
                cm.free(rid)
                del live[rid]
            cm.check_invariants()
            held: set[int] = set()
            for rid, (_, computed, allocated) in live.items():
                table = cm.get_block_table(rid)
                assert len(table) == -(-allocated // bs), f"seed {seed}: {rid} table length"
                skipped = min(max(0, computed - window + 1) // bs, len(table))
                if wait:
                    skipped = min(skipped, registered[rid])
                assert cm.num_skipped(rid) == skipped, f"seed {seed}: {rid} keeps blocks behind its window"
                held.update(b for b in table if b != cm.null_block)
            assert cm.get_num_free_blocks() == total - len(held), f"seed {seed}: free count"
        for rid in list(live):
            cm.free(rid)
        cm.check_invariants()
        assert cm.get_num_free_blocks() == total
