"""Prefix caching: chained block hashes, hits shared by reference count, LRU eviction, the last
token always computed, preemption and abort, counters, and unchanged greedy outputs on a real
tiny checkpoint.

The scheduler tests run a `KVCheckingExecutor`: it keeps what every KV slot was written with
(token, position) and, before each step, checks that every position a sequence attends to holds
that sequence's own token at that position. A wrong hit, a block evicted while still in use, or a
cached block written again fails it at once.
"""

from __future__ import annotations

import random

import pytest

from common.batch import Batch, ExecutorOutput
from common.config import ExecutorInfo, SchedulerConfig
from common.protocol import EngineStatus, decode, encode
from common.sampling_params import SamplingParams
from scheduler.cache_manager import ROOT_HASH, CacheManager, extra_keys, hash_block
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.test_scheduler import VOCAB, expected_output, next_token

BS = 4


class KVCheckingExecutor:
    """A scripted executor (next token = f(last token, position)) that also audits the KV cache."""

    def __init__(self, num_blocks: int, block_size: int = BS, max_model_len: int = 64) -> None:
        self.info = ExecutorInfo("kv-checking", num_blocks, block_size, max_model_len, [0], VOCAB)
        self.requests: dict[str, Request] = {}  # the scheduler's, to know each sequence's tokens
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (token, position) written there
        self.batches: list[Batch] = []
        self.written = 0  # tokens computed, over all steps

    def execute_model(self, batch: Batch) -> ExecutorOutput:
        batch.check()
        self.batches.append(batch)
        bs = self.info.block_size
        # Every slot of this step belongs to its sequence alone: no two sequences write one slot.
        assert len(set(batch.slot_mapping)) == len(batch.slot_mapping)
        for token, pos, slot in zip(batch.input_ids, batch.positions, batch.slot_mapping):
            self.slots[slot] = (token, pos)
        self.written += len(batch.input_ids)
        out = ExecutorOutput()
        start = 0
        for i, request_id in enumerate(batch.request_ids):
            q, s, table = batch.query_lens[i], batch.seq_lens[i], batch.block_tables[i]
            start += q
            request = self.requests[request_id]
            for p in range(s):  # everything this sequence attends to
                slot = table[p // bs] * bs + p % bs
                want = (request.tokens_between(p, p + 1)[0], p)
                assert self.slots.get(slot) == want, f"{request_id}: position {p} holds {self.slots.get(slot)}"
            last, pos = batch.input_ids[start - 1], batch.positions[start - 1]
            out.token_ids.append(next_token(last, pos) if batch.sample[i] else -1)
            out.logprobs.append(None)
        return out


def make(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8, caching: bool = True):
    ex = KVCheckingExecutor(num_blocks)
    sched = Scheduler(SchedulerConfig(budget, max_seqs, enable_prefix_caching=caching), CacheManager(num_blocks, BS), ex)
    ex.requests = sched.requests
    return sched, ex


def plans(ex: KVCheckingExecutor, start: int = 0) -> list[dict[str, int]]:
    return [dict(zip(b.request_ids, b.query_lens)) for b in ex.batches[start:]]


def run(sched: Scheduler, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        sched.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while sched.has_unfinished():
        for o in sched.schedule():
            got[o.request_id] += o.new_token_ids
        sched.cache.check_invariants()
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


def test_salt_keeps_equal_prompts_apart() -> None:
    sched, ex = make()
    prompt = list(range(1, 11))
    run(sched, [Request("a", prompt, GREEDY, cache_salt="tenant-1")])
    run(sched, [Request("b", prompt, GREEDY, cache_salt="tenant-2"), Request("n", prompt, GREEDY)])
    assert sched.prefix_cache_hits == 0
    run(sched, [Request("c", prompt, GREEDY, cache_salt="tenant-1")])
    assert plans(ex)[-3] == {"c": 2}  # 8 of 10 tokens hit (2 full blocks; never the last token)
    assert sched.prefix_cache_hits == 8


# -- hits ----------------------------------------------------------------------------------------
def test_shared_prefix_hits_and_shares_blocks() -> None:
    sched, ex = make()
    prefix = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]  # three full blocks
    a = Request("a", prefix + [3, 1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sched.add_request(a)
    sched.schedule()  # a's prompt: its three full blocks are registered after the step
    assert len(sched.cache.cached_blocks) == 3
    b = Request("b", prefix + [4, 1, 5], GREEDY)
    sched.add_request(b)
    sched.schedule()
    assert plans(ex)[-1] == {"a": 1, "b": 3}  # b computes only its own tokens
    table_a, table_b = sched.cache.get_block_table("a"), sched.cache.get_block_table("b")
    assert table_a[:3] == table_b[:3] and table_a[3] != table_b[3]
    assert [sched.cache.blocks[i].ref_cnt for i in table_b] == [2, 2, 2, 1]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (14 + 15, 12)
    while sched.has_unfinished():
        sched.schedule()
        sched.cache.check_invariants()
    assert a.output_token_ids == expected_output(a.prompt_token_ids, a.sampling_params)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, GREEDY)
    # Both finished: every block is free again, and the cache keeps what was registered.
    assert sched.cache.get_num_free_blocks() == 64 and len(sched.cache.cached_blocks) >= 4


def test_requests_of_one_step_do_not_hit_each_other() -> None:
    """Blocks are registered only after the step that computed them succeeded."""
    sched, ex = make()
    prompt = [5] * 9
    run(sched, [Request("a", prompt, GREEDY), Request("b", prompt, GREEDY)])
    assert plans(ex)[0] == {"a": 9, "b": 9} and sched.prefix_cache_hits == 0
    # Both computed the same two full blocks (11 tokens each); only a's copies are cache entries.
    assert len(sched.cache.cached_blocks) == 2


@pytest.mark.parametrize("extra, computes", [(0, BS), (1, 1), (3, 3)])
def test_last_prompt_token_is_always_computed(extra: int, computes: int) -> None:
    """A prompt of exactly k blocks, all cached, recomputes its last block (a cached block is never
    written again); with 1..3 tokens past the last full block, only those are computed."""
    sched, ex = make()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8] + [9, 7, 9][:extra]
    run(sched, [Request("first", prompt, GREEDY)])
    mark = len(ex.batches)
    got = run(sched, [Request("again", list(prompt), GREEDY)])
    assert plans(ex, mark)[0] == {"again": computes}
    assert ex.batches[mark].sample == [True]
    assert got["again"] == expected_output(prompt, GREEDY)
    # A one-block prompt after a full hit still computes its whole single block.
    mark = len(ex.batches)
    run(sched, [Request("one", prompt[:BS], GREEDY)])
    assert plans(ex, mark)[0] == {"one": BS}


def test_disabled_never_hits_or_registers() -> None:
    sched, ex = make(caching=False)
    prompt = list(range(1, 14))
    run(sched, [Request("a", prompt, GREEDY)])
    run(sched, [Request("b", prompt, GREEDY)])
    assert plans(ex)[-3] == {"b": 13}
    assert sched.cache.cached_blocks == {} and (sched.prefix_cache_queries, sched.prefix_cache_hits) == (0, 0)


# -- eviction --------------------------------------------------------------------------------------
def _computed(cm: CacheManager, request: Request) -> None:
    """Allocate ``request`` with its hit and register its full blocks, as one successful step would."""
    blocks, _ = cm.get_computed_blocks(request)
    assert cm.allocate_slots(request.request_id, request.num_tokens, blocks)
    request.num_computed_tokens = request.num_tokens
    cm.cache_full_blocks(request)


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
def test_preemption_recompute_hits_its_own_blocks() -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sched, _ = make(num_blocks=8, budget=64)
    a, b = Request("a", [1] * 7, params), Request("b", [2] * 7, params)
    for r in (a, b):
        sched.add_request(r)
    got: dict[str, list[int]] = {"a": [], "b": []}
    while sched.num_preemptions == 0:
        for o in sched.schedule():
            got[o.request_id] += o.new_token_ids
        sched.cache.check_invariants()
    assert [r.request_id for r in sched.waiting] == ["b"] and b.num_computed_tokens == 0
    hits = sched.prefix_cache_hits
    while sched.has_unfinished():
        for o in sched.schedule():
            got[o.request_id] += o.new_token_ids
        sched.cache.check_invariants()
    assert got == {"a": expected_output(a.prompt_token_ids, params), "b": expected_output(b.prompt_token_ids, params)}
    assert sched.prefix_cache_hits > hits  # b found (part of) what it had computed


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefixes_with_preemption_and_abort(seed: int) -> None:
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
        sched, _ = make(num_blocks=12, budget=budget, max_seqs=6, caching=caching)
        got: dict[str, list[int]] = {}
        pending = list(requests)
        step = 0
        while pending or sched.has_unfinished():
            for _ in range(min(len(pending), 3)):  # arrivals over time
                rid, prompt, params, salt = pending.pop(0)
                sched.add_request(Request(rid, list(prompt), params, cache_salt=salt))
                got[rid] = []
            for o in sched.schedule():
                got[o.request_id] += o.new_token_ids
            step += 1
            for rid in sorted(doomed):
                if step == 2 + int(rid) % 5 and rid in sched.requests:
                    sched.abort(rid)
            sched.cache.check_invariants()
        assert sched.cache.get_num_free_blocks() == 12 and not sched.cache.block_tables
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
    sched, _ = make()
    prefix = [4, 4, 2, 2, 6, 6, 1, 1]
    a = Request("a", prefix + [9], params)
    sched.add_request(a)
    sched.schedule()
    b = Request("b", prefix + [8], params)
    sched.add_request(b)
    sched.schedule()
    shared = sched.cache.get_block_table("b")[:2]
    assert shared == sched.cache.get_block_table("a")[:2] and all(sched.cache.blocks[i].ref_cnt == 2 for i in shared)
    sched.abort("a")
    sched.cache.check_invariants()
    assert all(sched.cache.blocks[i].ref_cnt == 1 for i in shared)
    while sched.has_unfinished():
        sched.schedule()
        sched.cache.check_invariants()
    assert b.output_token_ids == expected_output(b.prompt_token_ids, params)
    assert sched.cache.get_num_free_blocks() == 64


def test_reset_executor_to_another_block_size_rehashes() -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sched, _ = make()
    prompt = list(range(1, 12))
    for rid in "ab":
        sched.add_request(Request(rid, list(prompt), params))
    for _ in range(3):
        sched.schedule()
    assert all(len(r.block_hashes) > 0 for r in sched.requests.values())
    new_ex = KVCheckingExecutor(32, block_size=8)
    new_ex.requests = sched.requests
    sched.reset_executor(new_ex, CacheManager(32, 8))
    assert all(r.block_hashes == [] for r in sched.requests.values())
    got = {rid: list(r.output_token_ids) for rid, r in sched.requests.items()}
    while sched.has_unfinished():
        for o in sched.schedule():
            got[o.request_id] += o.new_token_ids
        sched.cache.check_invariants()
    assert got == {"a": expected_output(prompt, params), "b": expected_output(prompt, params)}


class DeltaRoundTrip(KVCheckingExecutor):
    """Sends every batch the way the services do (`DeltaEncoder` -> wire -> `RequestStates`) and
    runs the batch the executor side rebuilt, which must equal the scheduler's."""

    def __init__(self, num_blocks: int) -> None:
        from executor.service import RequestStates
        from scheduler.stream_executor import DeltaEncoder

        super().__init__(num_blocks)
        self.encoder, self.states = DeltaEncoder(BS), RequestStates(BS)
        self.step = 0
        self.first_windows: list[tuple[str, int]] = []  # (request, first position) of new requests

    def execute_model(self, batch: Batch) -> ExecutorOutput:
        self.step += 1
        self.encoder.release([r for r in list(self.encoder.mirrors) if r not in self.requests])  # finished
        delta = decode(encode(self.encoder.encode(batch, epoch=1, step=self.step)))
        for request_id in delta.new_ids:
            i = batch.request_ids.index(request_id)
            self.first_windows.append((request_id, batch.seq_lens[i] - batch.query_lens[i]))
        rebuilt = self.states.apply(delta)
        assert rebuilt == batch
        return super().execute_model(rebuilt)


def test_stream_executor_deltas_carry_a_first_window_past_position_zero() -> None:
    """A hit makes a new request's first window start at the cached length: the delta sends only
    the window (the executor pads what precedes it), and later steps and preemption still agree."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ex = DeltaRoundTrip(10)
    sched = Scheduler(SchedulerConfig(64, 8), CacheManager(10, BS), ex)
    ex.requests = sched.requests
    prefix = [6, 1, 6, 2, 6, 3, 6, 4, 6, 5]
    got = run(sched, [Request("a", prefix + [1], params)])
    got |= run(sched, [Request(r, prefix + [i + 2, i], params) for i, r in enumerate("bcd")])
    assert ("b", 8) in ex.first_windows and sched.num_preemptions > 0
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
    sched, _ = make()
    run(sched, [Request("a", list(range(1, 10)), GREEDY)])
    run(sched, [Request("b", list(range(1, 10)), GREEDY)])
    service.engine = sched
    status = service.status()
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (18, 8)


def test_scheduler_flag_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.cli import build_parser

    monkeypatch.setenv("CONVEYOR_ENABLE_PREFIX_CACHING", "0")
    assert build_parser().parse_args([]).enable_prefix_caching is False
    assert build_parser().parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True


# -- the real model ----------------------------------------------------------------------------------
def test_offline_greedy_outputs_identical_with_and_without(tiny_model) -> None:
    from scheduler import LLM

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
