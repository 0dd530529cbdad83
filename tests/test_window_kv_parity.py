"""Window-aware KV freeing through the offline `LLM`, token-exact against transformers.

A Mistral checkpoint with a window much shorter than its prompts, in a pool that holds about one
whole request: with the blocks behind the window freed, the requests run side by side without a
preemption; keeping every block (``free_window_blocks=False``), they preempt each other. Both give
transformers' tokens, and a repeated prompt resumes from a window hit (null blocks before its tail).
"""

from __future__ import annotations

import random

import pytest

from common import SamplingParams
from gateway.llm import LLM
from tests.test_engine import hf_greedy
from tests.test_model_families import assert_greedy_matches, hf_model

pytestmark = pytest.mark.model

WINDOW = 12
MAX_TOKENS = 8
ENGINE = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=96)


@pytest.mark.parametrize("free", [True, False], ids=["freeing", "keeping"])
def test_freeing_window_blocks_fits_more_and_keeps_parity(tiny_model, free: bool) -> None:
    path = tiny_model("mistral", sliding_window=WINDOW)
    llm = LLM(path, num_blocks=12, free_window_blocks=free, **ENGINE)  # 96 tokens: one request whole
    assert llm.executor.info.sliding_window == WINDOW
    rng = random.Random(7)
    vocab = llm.executor.info.vocab_size
    ps = [[rng.randrange(3, vocab) for _ in range(n)] for n in (70, 75, 80, 62)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(ps, params)
    if free:
        assert llm.scheduler.num_preemptions == 0, "freed window blocks should let all four fit"
    else:
        assert llm.scheduler.num_preemptions > 0, "keeping every block, four requests cannot fit"
    alone = llm.generate([ps[1]], params)[0]  # alone: nothing evicts its blocks before the next
    hits = llm.scheduler.prefix_cache_hits
    again = llm.generate([ps[1]], params)[0]  # a hit: its window's tail blocks are still cached
    assert llm.scheduler.prefix_cache_hits - hits == (len(ps[1]) - 1) // 8 * 8
    hf = hf_model(path)
    for prompt, out in zip(ps, outs):
        want, ref = hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_matches(out.token_ids, out.logprobs, want, ref)
    assert again.token_ids == alone.token_ids == outs[1].token_ids
    llm.cache_manager.check_invariants()
    assert llm.cache_manager.get_num_free_blocks() == 12


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("free", [True, False], ids=["freeing", "keeping"])
def test_hybrid_models_free_window_groups_and_keep_parity(tiny_model, arch: str, free: bool) -> None:
    """Gemma's alternating window and full layers run as two KV-cache groups of one pool: the
    window group frees what its window left, the full group keeps every block. A budget of 20
    blocks of every layer (40 of one layer slot) is smaller than four requests' tables, so
    requests wait or preempt each other; every output is transformers', and a repeated prompt
    resumes from a hit that both groups serve."""
    path = tiny_model(arch, sliding_window=WINDOW)
    llm = LLM(path, num_blocks=20, free_window_blocks=free, **ENGINE)
    info = llm.executor.info
    assert info.sliding_window is None and info.kv_group_windows == [0, WINDOW] and info.num_blocks == 40
    rng = random.Random(11)
    vocab = info.vocab_size
    ps = [[rng.randrange(3, vocab) for _ in range(n)] for n in (70, 75, 80, 62)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(ps, params)
    llm.reset_prefix_cache()  # alone, every block it computes is registered (none is a duplicate)
    alone = llm.generate([ps[2]], params)[0]
    hits = llm.scheduler.prefix_cache_hits
    again = llm.generate([ps[2]], params)[0]  # a hit both groups serve: every full block, the window's tail
    assert llm.scheduler.prefix_cache_hits - hits == (len(ps[2]) - 1) // 8 * 8
    hf = hf_model(path)
    for prompt, out in zip(ps, outs):
        want, ref = hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_matches(out.token_ids, out.logprobs, want, ref)
    assert again.token_ids == alone.token_ids == outs[2].token_ids
    llm.cache_manager.check_invariants()
    assert llm.cache_manager.get_num_free_blocks() == 40
