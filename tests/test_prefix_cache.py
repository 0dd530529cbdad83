"""Prefix caching: chained block hashes, hits shared by reference count, LRU eviction, the last
token always computed, preemption and abort, counters, and unchanged greedy outputs on a real
tiny checkpoint.

The scheduler tests run a `KVCheckingExecutor`: it keeps what every KV slot was written with
(token, position) and, before each step, checks that every position a sequence attends to holds
that sequence's own token at that position. A wrong hit, a block evicted while still in use, or a
cached block written again fails it at once. It also checks that the request state it keeps (its
`PersistentBatch`, built from the scheduler's `SchedulerOutput` deltas) agrees with the
scheduler's: the same tokens (and one more per token still on its way) and the same block table.
Tests about outputs run with and without async scheduling.
"""

from __future__ import annotations

import random

import pytest

from common.config import ExecutorInfo, SchedulerConfig
from common.prefix_hash import ROOT_HASH, extra_keys, hash_block
from common.protocol import EngineStatus, ExecutorOutput, SchedulerOutput, decode, encode
from common.sampling_params import SamplingParams
from executor.input_batch import Batch
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.fake_executor import FakeExecutor
from tests.test_scheduler import BOTH, VOCAB, expected_output, next_token

pytestmark = pytest.mark.unit

BS = 4


class KVCheckingExecutor(FakeExecutor):
    """A scripted executor (next token = f(last token, position)) that also audits the KV cache.

    Like `ModelExecutor`, it keeps each request's state in a `PersistentBatch` built from the
    scheduler's steps (and drops it all when a step fails). `InlineExecutor` runs a step as soon
    as it is scheduled, so the scheduler's state (``sched``) is that step's at each call.
    """

    def __init__(self, num_blocks: int, block_size: int = BS, max_model_len: int = 64) -> None:
        super().__init__(ExecutorInfo("kv-checking", num_blocks, block_size, max_model_len, [0], VOCAB))
        self.sched: Scheduler | None = None  # to compare the executor's view with the scheduler's
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (token, position) written there
        self.written = 0  # tokens computed, over all steps

    def run_batch(self, batch: Batch) -> list[int]:
        batch.check()
        sched = self.sched
        assert sched is not None
        bs = self.info.block_size
        # The executor's request state is the scheduler's: its known tokens, plus the one a step
        # still on its way sampled (async scheduling), and the very same block table.
        for i, request_id in enumerate(batch.request_ids):
            request, tokens = sched.requests[request_id], self.state.requests[request_id].token_ids
            assert tokens[: request.num_tokens] == request.tokens_between(0, request.num_tokens)
            assert len(tokens) == request.num_tokens + request.num_output_placeholders - batch.sample[i]
            assert self.state.table(request_id).tolist() == list(sched.cache.get_block_table(request_id))
        # Every slot of this step belongs to its sequence alone: no two sequences write one slot.
        assert len(set(batch.slot_mapping)) == len(batch.slot_mapping)
        for token, pos, slot in zip(batch.input_ids, batch.positions, batch.slot_mapping):
            self.slots[slot] = (token, pos)
        self.written += len(batch.input_ids)
        token_ids = []
        start = 0
        for i, request_id in enumerate(batch.request_ids):
            q, s, table = batch.query_lens[i], batch.seq_lens[i], batch.block_tables[i]
            start += q
            tokens = self.state.requests[request_id].token_ids
            for p in range(s):  # everything this sequence attends to
                slot = table[p // bs] * bs + p % bs
                want = (tokens[p], p)
                assert self.slots.get(slot) == want, f"{request_id}: position {p} holds {self.slots.get(slot)}"
            last, pos = batch.input_ids[start - 1], batch.positions[start - 1]
            token_ids.append(next_token(last, pos) if batch.sample[i] else -1)
        return token_ids


def attach(ex: KVCheckingExecutor, sched: Scheduler, async_scheduling: bool = False) -> EngineCore:
    ex.sched = sched
    return EngineCore(sched, InlineExecutor(ex), async_scheduling=async_scheduling)


def make(
    num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, caching: bool = True, async_scheduling: bool = False
) -> tuple[Scheduler, KVCheckingExecutor, EngineCore]:
    ex = KVCheckingExecutor(num_blocks)
    config = SchedulerConfig(budget, max_seqs, enable_prefix_caching=caching)
    sched = Scheduler(config, CacheManager(num_blocks, BS), ex.info)
    return sched, ex, attach(ex, sched, async_scheduling)


def plans(ex: KVCheckingExecutor, start: int = 0) -> list[dict[str, int]]:
    return [dict(zip(b.request_ids, b.query_lens)) for b in ex.batches[start:]]


def step(core: EngineCore, got: dict[str, list[int]] | None = None) -> None:
    """One engine step; its tokens are appended to ``got`` (which holds every earlier one)."""
    for o in core.step():
        if got is not None:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.num_output_tokens == len(got[o.request_id])
    core.scheduler.cache.check_invariants()


def drain(core: EngineCore, got: dict[str, list[int]] | None = None) -> dict[str, list[int]] | None:
    while core.has_work():
        step(core, got)
    return got


def run(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        core.scheduler.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    drain(core, got)
    assert all(got[r.request_id] == r.output_token_ids for r in requests)
    return got


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


# -- hashes ------------------------------------------------------------------------------------
def test_hashes_chain_and_salt_separates() -> None:
    cm = CacheManager(16, BS)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY)
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 10], GREEDY)  # differs only after two full blocks
    c = Request("c", [9, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY)  # differs in the first token
    ha, hb, hc = (cm.block_hashes(r, r.num_tokens) for r in (a, b, c))
    assert len(ha) == 2 and ha == hb  # the partial third block is never hashed
    assert ha[0] == hash_block(ROOT_HASH, [1, 2, 3, 4]) and ha[1] == hash_block(ha[0], [5, 6, 7, 8])
    assert hc[0] != ha[0] and hc[1] != ha[1]  # a change in block 0 changes every later hash
    assert hash_block(ROOT_HASH, [5, 6, 7, 8]) != ha[1]  # same tokens, other parent
    assert a.block_hashes is ha and cm.block_hashes(a, 8) is ha  # computed once, kept on the request
    # Salts: none, empty and two different ones all differ; the same salt agrees.
    salted = [Request(str(i), list(a.prompt_token_ids), GREEDY, cache_salt=s) for i, s in enumerate(["", "x", "y", "x"])]
    hs = [cm.block_hashes(r, 8) for r in salted]
    assert len({ha[0], hs[0][0], hs[1][0], hs[2][0]}) == 4 and hs[1] == hs[3]
    assert extra_keys(None) == b"" and extra_keys("") != b""


@BOTH
def test_salt_keeps_equal_prompts_apart(async_scheduling: bool) -> None:
    sched, ex, core = make(async_scheduling=async_scheduling)
    prompt = list(range(1, 11))
    run(core, [Request("a", prompt, GREEDY, cache_salt="tenant-1")])
    run(core, [Request("b", prompt, GREEDY, cache_salt="tenant-2"), Request("n", prompt, GREEDY)])
    assert sched.prefix_cache_hits == 0
    got = run(core, [Request("c", prompt, GREEDY, cache_salt="tenant-1")])
    assert got["c"] == expected_output(prompt, GREEDY)
    assert plans(ex)[-3] == {"c": 2}  # 8 of 10 tokens hit (2 full blocks; never the last token)
    assert sched.prefix_cache_hits == 8


# -- hits ----------------------------------------------------------------------------------------
def test_shared_prefix_hits_and_shares_blocks() -> None:
    sched, ex, core = make()
    prefix = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]  # three full blocks
    a = Request("a", prefix + [3, 1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sched.add_request(a)
    core.step()  # a's prompt: its three full blocks are registered after the step
    assert len(sched.cache.cached_blocks) == 3
    b = Request("b", prefix + [4, 1, 5], GREEDY)
    sched.add_request(b)
    core.step()
    assert plans(ex)[-1] == {"a": 1, "b": 3}  # b computes only its own tokens
    table_a, table_b = sched.cache.get_block_table("a"), sched.cache.get_block_table("b")
    assert table_a[:3] == table_b[:3] and table_a[3] != table_b[3]
    assert [sched.cache.blocks[i].ref_cnt for i in table_b] == [2, 2, 2, 1]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (14 + 15, 12)
    drain(core)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, a.sampling_params)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, GREEDY)
    # Both finished: every block is free again, and the cache keeps what was registered.
    assert sched.cache.get_num_free_blocks() == 64 and len(sched.cache.cached_blocks) >= 4


def test_async_registers_blocks_when_the_step_output_arrives() -> None:
    """With a step scheduled ahead, a step's blocks are registered only once its output is applied
    (a request admitted meanwhile cannot hit them yet); then the next admission hits."""
    sched, ex, core = make(async_scheduling=True)
    prefix = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]  # three full blocks
    a = Request("a", prefix + [3, 1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sched.add_request(a)
    core.step()  # a's prompt is on its way
    assert len(core.in_flight) == 1 and sched.cache.cached_blocks == {}
    b = Request("b", prefix + [4, 1, 5], GREEDY)
    sched.add_request(b)
    core.step()  # b is admitted before a's prompt step has answered: no hit; then that answer registers
    assert plans(ex)[-1] == {"a": 1, "b": 15} and sched.prefix_cache_hits == 0
    assert len(sched.cache.cached_blocks) == 3
    c = Request("c", prefix + [6], GREEDY)
    sched.add_request(c)
    core.step()
    assert plans(ex)[-1]["c"] == 1 and sched.prefix_cache_hits == 12
    got = drain(core, {r.request_id: list(r.output_token_ids) for r in (a, b, c)})
    assert got == {r.request_id: expected_output(r.prompt_token_ids, r.sampling_params) for r in (a, b, c)}
    assert sched.cache.get_num_free_blocks() == 64


@BOTH
def test_requests_of_one_step_do_not_hit_each_other(async_scheduling: bool) -> None:
    """Blocks are registered only after the step that computed them succeeded."""
    sched, ex, core = make(async_scheduling=async_scheduling)
    prompt = [5] * 9
    got = run(core, [Request("a", prompt, GREEDY), Request("b", prompt, GREEDY)])
    assert got["a"] == got["b"] == expected_output(prompt, GREEDY)
    assert plans(ex)[0] == {"a": 9, "b": 9} and sched.prefix_cache_hits == 0
    # Both computed the same two full blocks (11 tokens each); only a's copies are cache entries.
    assert len(sched.cache.cached_blocks) == 2


@BOTH
@pytest.mark.parametrize("extra, computes", [(0, BS), (1, 1), (3, 3)])
def test_last_prompt_token_is_always_computed(extra: int, computes: int, async_scheduling: bool) -> None:
    """A prompt of exactly k blocks, all cached, recomputes its last block (a cached block is never
    written again); with 1..3 tokens past the last full block, only those are computed."""
    sched, ex, core = make(async_scheduling=async_scheduling)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8] + [9, 7, 9][:extra]
    run(core, [Request("first", prompt, GREEDY)])
    mark = len(ex.batches)
    got = run(core, [Request("again", list(prompt), GREEDY)])
    assert plans(ex, mark)[0] == {"again": computes}
    assert ex.batches[mark].sample.tolist() == [True]
    assert got["again"] == expected_output(prompt, GREEDY)
    # A one-block prompt after a full hit still computes its whole single block.
    mark = len(ex.batches)
    run(core, [Request("one", prompt[:BS], GREEDY)])
    assert plans(ex, mark)[0] == {"one": BS}


@BOTH
def test_disabled_never_hits_or_registers(async_scheduling: bool) -> None:
    sched, ex, core = make(caching=False, async_scheduling=async_scheduling)
    prompt = list(range(1, 14))
    run(core, [Request("a", prompt, GREEDY)])
    run(core, [Request("b", prompt, GREEDY)])
    assert plans(ex)[-3] == {"b": 13}
    assert sched.cache.cached_blocks == {} and (sched.prefix_cache_queries, sched.prefix_cache_hits) == (0, 0)


# -- eviction --------------------------------------------------------------------------------------
def _computed(cm: CacheManager, request: Request) -> None:
    """Allocate ``request`` with its hit and register its full blocks, as one successful step would."""
    blocks, _ = cm.get_computed_blocks(request)
    assert cm.allocate_slots(request.request_id, request.num_tokens, blocks)
    request.num_computed_tokens = request.num_tokens
    cm.cache_full_blocks(request, request.num_computed_tokens)


def test_lru_eviction_order() -> None:
    cm = CacheManager(8, BS)
    a = Request("a", [1] * 8 + [0], GREEDY)  # two full blocks (+1 token: 3 blocks)
    b = Request("b", [2] * 8 + [0], GREEDY)
    _computed(cm, a)
    _computed(cm, b)
    assert cm.get_block_table("a") == [0, 1, 2] and cm.get_block_table("b") == [3, 4, 5]
    cm.free("a")
    cm.free("b")
    # Never-used blocks first, then a's (freed first; tail first), then b's.
    assert cm.free_queue.block_ids() == [6, 7, 2, 1, 0, 5, 4, 3]
    assert len(cm.cached_blocks) == 4
    # A hit takes a's blocks out of the queue; freed again, they are the most recently used.
    a2 = Request("a2", list(a.prompt_token_ids), GREEDY)
    assert cm.get_computed_blocks(a2) == ([0, 1], 8)
    _computed(cm, a2)
    assert cm.get_block_table("a2") == [0, 1, 6]
    cm.free("a2")
    assert cm.free_queue.block_ids() == [7, 2, 5, 4, 3, 6, 1, 0]
    # Four blocks: two never cached, then b's tail block (evicted); a's stay cached.
    assert cm.allocate_blocks(4) == [7, 2, 5, 4] and cm.num_evictions == 1
    assert cm.get_computed_blocks(Request("b3", list(b.prompt_token_ids), GREEDY)) == ([3], 4)
    assert cm.allocate_blocks(1) == [3] and cm.num_evictions == 2
    assert cm.get_computed_blocks(Request("b4", list(b.prompt_token_ids), GREEDY)) == ([], 0)
    assert cm.get_computed_blocks(Request("a3", list(a.prompt_token_ids), GREEDY)) == ([0, 1], 8)
    cm.free_blocks([7, 2, 5, 4, 3])
    cm.check_invariants()


def test_hit_is_all_or_nothing_and_counts_reclaimed_blocks() -> None:
    cm = CacheManager(4, BS)
    a = Request("a", [1] * 13, GREEDY)  # 3 full blocks + 1 token: the whole pool
    _computed(cm, a)
    cm.free("a")
    # 12 cached tokens, but the hit (3 free blocks) plus one new block is the whole pool: fits.
    b = Request("b", [1] * 12 + [2, 2], GREEDY)
    blocks, hit = cm.get_computed_blocks(b)
    assert hit == 12 and cm.allocate_slots("b", 14, blocks)
    # Another request wanting the same hit plus a new block does not fit, and nothing changes.
    c = Request("c", [1] * 12 + [3], GREEDY)
    blocks, hit = cm.get_computed_blocks(c)
    assert hit == 12
    free_before, refs = cm.get_num_free_blocks(), [blk.ref_cnt for blk in cm.blocks]
    assert not cm.allocate_slots("c", 16 + 1, blocks)
    assert cm.get_num_free_blocks() == free_before and [blk.ref_cnt for blk in cm.blocks] == refs
    assert "c" not in cm.block_tables
    cm.free("b")
    cm.check_invariants()


# -- preemption, abort, faults -------------------------------------------------------------------
@BOTH
def test_preemption_recompute_hits_its_own_blocks(async_scheduling: bool) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sched, ex, core = make(num_blocks=8, budget=64, async_scheduling=async_scheduling)
    a, b = Request("a", [1] * 7, params), Request("b", [2] * 7, params)
    for r in (a, b):
        sched.add_request(r)
    got: dict[str, list[int]] = {"a": [], "b": []}
    while sched.num_preemptions == 0:
        step(core, got)
    assert [r.request_id for r in sched.waiting] == ["b"] and b.num_computed_tokens == 0
    start, known = len(ex.batches), b.num_tokens
    drain(core, got)
    assert got == {"a": expected_output(a.prompt_token_ids, params), "b": expected_output(b.prompt_token_ids, params)}
    recomputed = next(plan["b"] for plan in plans(ex, start) if "b" in plan)
    assert recomputed < known  # b found (part of) what it had computed


@BOTH
@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefixes_with_preemption_and_abort(seed: int, async_scheduling: bool) -> None:
    """Many requests over a few shared prefixes, a tight pool and random aborts: outputs equal the
    no-cache engine's, the KV audit passes every step, and the pool invariants hold throughout."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    requests = []
    for i in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
        salt = rng.choice([None, None, "s"])
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
        requests.append((str(i), prompt, params, salt))
    doomed = set(rng.sample([r[0] for r in requests], 4))
    budget = rng.choice([8, 16, 64])

    def drive(caching: bool) -> tuple[Scheduler, dict[str, list[int]]]:
        sched, ex, core = make(num_blocks=12, budget=budget, max_seqs=6, caching=caching, async_scheduling=async_scheduling)
        got: dict[str, list[int]] = {}
        pending = list(requests)
        steps = 0
        while pending or core.has_work():
            for _ in range(min(len(pending), 3)):  # arrivals over time
                rid, prompt, params, salt = pending.pop(0)
                sched.add_request(Request(rid, list(prompt), params, cache_salt=salt))
                got[rid] = []
            step(core, got)
            steps += 1
            for rid in sorted(doomed):
                if steps == 2 + int(rid) % 5 and rid in sched.requests:
                    sched.abort(rid)
            sched.cache.check_invariants()
        assert sched.cache.get_num_free_blocks() == 12 and not sched.cache.block_tables
        # The executor holds only what finished after the last step, which the next one drops.
        assert sched.executor_blocks == {} and set(ex.state.requests) == set(sched.finished_for_executor)
        return sched, got

    _, want = drive(caching=False)
    sched, got = drive(caching=True)
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0
    for rid, prompt, params, _ in requests:
        full = expected_output(prompt, params)
        assert got[rid] == full[: len(got[rid])]
        if rid not in doomed:
            assert got[rid] == full == want[rid]


def test_abort_of_a_sharer_leaves_the_other_intact() -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sched, _, core = make()
    prefix = [4, 4, 2, 2, 6, 6, 1, 1]
    a = Request("a", prefix + [9], params)
    sched.add_request(a)
    core.step()
    b = Request("b", prefix + [8], params)
    sched.add_request(b)
    core.step()
    shared = sched.cache.get_block_table("b")[:2]
    assert shared == sched.cache.get_block_table("a")[:2] and all(sched.cache.blocks[i].ref_cnt == 2 for i in shared)
    sched.abort("a")
    sched.cache.check_invariants()
    assert all(sched.cache.blocks[i].ref_cnt == 1 for i in shared)
    drain(core)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, params)
    assert sched.cache.get_num_free_blocks() == 64


@BOTH
def test_reset_executor_to_another_block_size_rehashes(async_scheduling: bool) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sched, _, core = make(async_scheduling=async_scheduling)
    prompt = list(range(1, 12))
    for rid in "ab":
        sched.add_request(Request(rid, list(prompt), params))
    for _ in range(3):
        core.step()
    assert all(len(r.block_hashes) > 0 for r in sched.requests.values())
    new_ex = KVCheckingExecutor(32, block_size=8)
    sched.reset_executor(new_ex.info, CacheManager(32, 8))
    core = attach(new_ex, sched, async_scheduling)  # a new core for the new executor, as the service does
    assert all(r.block_hashes == [] for r in sched.requests.values())
    got = {rid: list(r.output_token_ids) for rid, r in sched.requests.items()}
    drain(core, got)
    assert sched.cache.block_size == 8 and sched.cache.cached_blocks  # registered under the new hashes
    assert got == {"a": expected_output(prompt, params), "b": expected_output(prompt, params)}


class WireRoundTrip(KVCheckingExecutor):
    """Receives every step the way the executor service does (encoded for the wire, decoded, then
    applied to its `PersistentBatch`), which must lose nothing; records where each new request's
    first window starts."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.first_windows: list[tuple[str, int]] = []  # (request, first position) of new requests

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        wire = decode(encode(output), (SchedulerOutput,))
        assert wire == output
        for request_id, start in zip(wire.scheduled_req_ids, wire.num_computed_tokens):
            if request_id in wire.new_req_ids:
                self.first_windows.append((request_id, start))
        return super().execute_model(wire)


@BOTH
def test_wire_steps_carry_a_first_window_past_position_zero(async_scheduling: bool) -> None:
    """A hit makes a new request's first window start at the cached length: the step sends its
    whole prompt (the executor keeps every token) but schedules only the window after the hit,
    and later steps and preemption still agree."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ex = WireRoundTrip(10)
    sched = Scheduler(SchedulerConfig(64, 8), CacheManager(10, BS), ex.info)
    core = attach(ex, sched, async_scheduling)
    prefix = [6, 1, 6, 2, 6, 3, 6, 4, 6, 5]
    got = run(core, [Request("a", prefix + [1], params)])
    got |= run(core, [Request(r, prefix + [i + 2, i], params) for i, r in enumerate("bcd")])
    assert ("b", 8) in ex.first_windows and sched.num_preemptions > 0
    first_b = next(out for out in ex.outputs if "b" in out.new_req_ids)
    assert first_b.new_requests()[first_b.new_req_ids.index("b")].token_ids == prefix + [2, 0]
    assert any(any(out.cached_resumed) for out in ex.outputs)  # a preempted request came back
    for r, tail in zip("abcd", [[1], [2, 0], [3, 1], [4, 2]]):
        assert got[r] == expected_output(prefix + tail, params)


# -- counters and plumbing -------------------------------------------------------------------------
def test_counters_in_engine_status() -> None:
    status = EngineStatus("0", "i", "m", "/m", 64, 97, 4, 64, "", 0, 64, 0, 0, 0, 0, 0, 0.0)
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (0, 0)  # defaults: old callers work
    status.prefix_cache_queries, status.prefix_cache_hits = 100, 40
    back = decode(encode(status))
    assert (back.prefix_cache_queries, back.prefix_cache_hits) == (100, 40)


def test_scheduler_service_reports_counters_and_flag() -> None:
    from scheduler.cli import build_parser
    from scheduler.service import SchedulerService, SchedulerServiceConfig

    assert build_parser().parse_args([]).enable_prefix_caching is True
    assert build_parser().parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert SchedulerServiceConfig("redis://127.0.0.1:1/0").enable_prefix_caching is True
    service = SchedulerService(SchedulerServiceConfig("redis://127.0.0.1:1/0"))  # connects lazily
    assert (service.status().prefix_cache_queries, service.status().prefix_cache_hits) == (0, 0)
    sched, _, core = make()
    run(core, [Request("a", list(range(1, 10)), GREEDY)])
    run(core, [Request("b", list(range(1, 10)), GREEDY)])
    service.engine = sched
    status = service.status()
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (18, 8)


def test_scheduler_flag_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.cli import build_parser

    monkeypatch.setenv("CONVEYOR_ENABLE_PREFIX_CACHING", "0")
    assert build_parser().parse_args([]).enable_prefix_caching is False
    assert build_parser().parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True


# -- the real model ----------------------------------------------------------------------------------
@pytest.mark.model
def test_offline_greedy_outputs_identical_with_and_without(tiny_model) -> None:
    from gateway.llm import LLM

    model_dir = tiny_model("llama")
    kw = {"dtype": "float32", "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    on, off = LLM(model_dir, **kw), LLM(model_dir, **kw, enable_prefix_caching=False)
    assert on.scheduler_config.enable_prefix_caching and not off.scheduler_config.enable_prefix_caching
    rng = random.Random(0)
    vocab = on.executor.info.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 10, 26, 58)]
    prompts += [prefix[:64], prefix[:16], [rng.randrange(3, vocab) for _ in range(20)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = off.generate(prompts, params)
    got_first = on.generate(prompts, params)  # admitted over several steps: later ones hit earlier ones
    hits_first = on.scheduler.prefix_cache_hits
    got_again = on.generate(prompts, params)  # everything cached now (but each prompt's last token)
    assert 0 < hits_first < on.scheduler.prefix_cache_hits
    for w, g1, g2 in zip(want, got_first, got_again):
        assert g1.token_ids == w.token_ids == g2.token_ids
        for a, b in zip(w.logprobs, g2.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert off.scheduler.prefix_cache_hits == 0 and off.cache_manager.cached_blocks == {}
    on.cache_manager.check_invariants()
    assert on.cache_manager.get_num_free_blocks() == on.cache_manager.total_blocks
    on.reset_prefix_cache()
    assert on.cache_manager.cached_blocks == {}
    on.cache_manager.check_invariants()


def test_counters_follow_vllm_readmissions_and_skipped_lookups_are_not_queries() -> None:
    """vLLM's ``prefix_cache_queries`` counts lookups: not a request that skips the cache (it needs
    prompt logprobs), nor a readmission after a preemption; and its ``num_preemptions`` counts
    what memory pressure preempted, not requests resent because the executor was lost."""
    sched, ex, core = make()
    prompt = [7, 1, 8, 2, 8, 1, 8, 2, 3]
    sched.add_request(Request("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    step(core)
    assert (sched.prefix_cache_queries, sched.num_preemptions) == (9, 0)
    sched.executor_lost()  # every running request preempted and resent: no KV pressure
    ex.state.clear()
    assert sched.num_preemptions == 0 and sched.requests["a"].num_preemptions == 1
    step(core)  # "a" readmitted (a cache hit, not counted)
    assert sched.prefix_cache_queries == 9
    lp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    sched.add_request(Request("b", prompt, lp))  # computes every prompt position: no lookup
    drain(core)
    assert sched.prefix_cache_queries == 9
