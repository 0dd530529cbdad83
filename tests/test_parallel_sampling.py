"""``n`` > 1, ``best_of`` and ``prompt_logprobs`` in the offline engine, on a tiny checkpoint
(transformers is the oracle for prompt logprobs)."""

from __future__ import annotations

import random

import pytest
import torch

from common import SamplingParams
from common.parallel_sampling import child_params, cumulative_logprob, select_best
from common.sampling_params import INT64_MAX, INT64_MIN
from gateway.llm import LLM

pytestmark = pytest.mark.model

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), dtype="float32", block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=16)


def prompt_ids(llm: LLM, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, llm.executor.info.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("budget", [256, 24])
def test_siblings_share_the_prompt_blocks(llm: LLM, budget: int) -> None:
    """n samples compute the prompt once: the n - 1 siblings hit every full block of it (the
    prefix-cache counters), with the prefill whole or chunked over several steps."""
    llm.scheduler.config.max_num_batched_tokens = budget
    try:
        llm.reset_prefix_cache()
        prompt = prompt_ids(llm, 5 * BLOCK + 3)
        n = 4
        queries, hits = llm.scheduler.prefix_cache_queries, llm.scheduler.prefix_cache_hits
        [out] = llm.generate([prompt], SamplingParams(n=n, temperature=1.0, max_tokens=6, ignore_eos=True, seed=7))
        full = (len(prompt) - 1) // BLOCK * BLOCK  # the blocks a hit can cover
        assert llm.scheduler.prefix_cache_hits - hits == (n - 1) * full
        assert llm.scheduler.prefix_cache_queries - queries == n * len(prompt)
        assert [o.index for o in out.outputs] == list(range(n))
        assert all(len(o.token_ids) == 6 for o in out.outputs)
        llm.cache_manager.check_invariants()
    finally:
        llm.scheduler.config.max_num_batched_tokens = 256


def test_seeded_samples_differ_per_child_and_repeat(llm: LLM) -> None:
    prompt = prompt_ids(llm, 20, seed=1)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=1234)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    samples = [o.token_ids for o in first.outputs]
    assert samples == [o.token_ids for o in again.outputs]  # reproducible
    assert len({tuple(s) for s in samples}) == 3  # each child its own seed
    # Child i is exactly the n = 1 request with seed + i (vLLM's rule).
    for i, sample in enumerate(samples):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1234 + i))[0]
        assert single.token_ids == sample
    # Greedy: n identical choices.
    greedy = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert first.token_ids == samples[0] and first.text == first.outputs[0].text


def test_best_of_returns_the_highest_cumulative_logprobs(llm: LLM) -> None:
    prompt = prompt_ids(llm, 12, seed=2)
    params = SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=6, ignore_eos=True, seed=99)
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 2 and out.logprobs is None  # logprobs were computed to rank, not asked for
    # The same five children, run as n = 5 with their logprobs.
    every = llm.generate([prompt], SamplingParams(n=5, temperature=1.0, max_tokens=6, ignore_eos=True, seed=99, logprobs=0))[0]
    totals = [o.cumulative_logprob for o in every.outputs]
    assert all(t is not None for t in totals)
    best = sorted(range(5), key=lambda i: -totals[i])[:2]  # type: ignore[operator]
    assert [o.index for o in out.outputs] == best
    assert [o.token_ids for o in out.outputs] == [every.outputs[i].token_ids for i in best]
    for o in out.outputs:
        assert o.cumulative_logprob == pytest.approx(totals[o.index])


@pytest.mark.parametrize("budget", [256, 20])
def test_prompt_logprobs_match_transformers(llm: LLM, budget: int) -> None:
    """Each prompt token's logprob (and the top-k) equals transformers' log_softmax at the position
    before it, whole or chunked prefill; a cached prompt is recomputed for them."""
    from transformers import AutoModelForCausalLM

    llm.scheduler.config.max_num_batched_tokens = budget
    try:
        prompts = [prompt_ids(llm, 50, seed=3), prompt_ids(llm, 7, seed=4)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))  # now cached: must not be hit
        hits = llm.scheduler.prefix_cache_hits
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
        assert llm.scheduler.prefix_cache_hits == hits
    finally:
        llm.scheduler.config.max_num_batched_tokens = 256
    hf = AutoModelForCausalLM.from_pretrained(llm.model_config.model, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for pos in range(1, len(prompt)):
            entry = got[pos]
            assert entry is not None and prompt[pos] in entry
            for token, value in entry.items():
                assert abs(value - want[pos - 1, token].item()) < 1e-4
            assert set(torch.topk(want[pos - 1], 3).indices.tolist()) <= set(entry)


def test_prompt_logprobs_with_n_come_once(llm: LLM) -> None:
    prompt = prompt_ids(llm, 40, seed=5)
    [out] = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=2, prompt_logprobs=0))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 40 and out.prompt_logprobs[0] is None
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:] if e is not None)


def test_child_params_and_selection() -> None:
    base = SamplingParams(n=2, best_of=3, seed=INT64_MAX, prompt_logprobs=2)
    kids = [child_params(base, i) for i in range(3)]
    assert [k.seed for k in kids] == [INT64_MAX, INT64_MIN, INT64_MIN + 1]  # wrapped into int64
    assert all(k.n == 1 and k.best_of is None and k.logprobs == 0 for k in kids)
    assert [k.prompt_logprobs for k in kids] == [2, None, None]
    for k in kids:
        k.validate()
    assert child_params(SamplingParams(n=2), 1).logprobs is None  # no ranking: nothing extra
    assert cumulative_logprob([1, 2], [{1: -0.5}, {2: -1.0, 3: -0.1}]) == -1.5
    assert cumulative_logprob([1, 2], [{1: -0.5}, None]) is None
    assert select_best([-3.0, -1.0, None, -2.0], 2) == [1, 3]
    assert select_best([-3.0, -1.0], 2) == [0, 1]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(n=0), "^n must"),
        (SamplingParams(n=SamplingParams.MAX_N + 1), "^n must"),
        (SamplingParams(n=3, best_of=2), "^best_of must"),
        (SamplingParams(prompt_logprobs=SamplingParams.MAX_LOGPROBS + 1), "^prompt_logprobs must"),
    ],
)
def test_bad_parallel_params_raise(params: SamplingParams, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        params.validate()


def test_prompt_logprob_columns_round_trip() -> None:
    from common.codec import pack_prompt_logprobs, unpack_prompt_logprobs
    from common.protocol import StepOutputs, StepResult, decode, encode

    msg = StepOutputs()
    msg.add("a", 0, [5], None)
    msg.add("b", 0, [6], None, prompt_logprobs=[None, {3: -0.5, 4: -1.5}, {7: -2.0}])
    msg.add("c", 0, [7], None)
    got = decode(encode(msg.sealed()))
    assert got.prompt_logprobs() == [None, [None, {3: -0.5, 4: -1.5}, {7: -2.0}], None]
    plain = StepOutputs()
    plain.add("a", 0, [5], None)
    assert decode(encode(plain.sealed())).plp_num == []  # no column when nobody asked
    rows: list = [None, [{1: -0.25}], [], None]
    result = StepResult(0, 1, [1, 2, 3, 4])
    # The rank column has its own round trip (test_prompt_logprob_ranks.py); the values' is this one.
    result.plp_num, result.plp_counts, result.plp_token_ids, result.plp_values, _ = pack_prompt_logprobs(rows)
    back = decode(encode(result))
    assert unpack_prompt_logprobs(4, back.plp_num, back.plp_counts, back.plp_token_ids, back.plp_values) == rows
    assert pack_prompt_logprobs([None, None]) == ([], [], [], [], [])


def test_siblings_without_prefix_caching_run_side_by_side(tiny_model) -> None:
    """No cache to share through: siblings are not held, and give the same samples."""
    opts: dict = {"dtype": "float32", "block_size": BLOCK, "num_blocks": 128, "max_num_batched_tokens": 256}
    plain = LLM(tiny_model("llama"), enable_prefix_caching=False, **opts)
    prompt = prompt_ids(plain, 3 * BLOCK + 2, seed=6)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True, seed=5)
    [out] = plain.generate([prompt], params)
    assert plain.scheduler.prefix_cache_hits == 0
    cached = LLM(tiny_model("llama"), **opts)
    assert [o.token_ids for o in cached.generate([prompt], params)[0].outputs] == [o.token_ids for o in out.outputs]


def test_allowed_token_ids_in_the_engine(llm: LLM) -> None:
    """vLLM's ``allowed_token_ids``: greedy picks the best allowed token at every step (equal to the
    argmax of the raw logits over those ids), sampling stays inside them, batch mates are untouched;
    ``min_tokens`` that would ban every allowed token (EOS alone) leaves them allowed."""
    prompt = prompt_ids(llm, 12, seed=3)
    allowed = [7, 11, 13, 42]
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(
        [prompt, prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed, logprobs=20),
            SamplingParams(temperature=1.0, seed=1, max_tokens=32, ignore_eos=True, allowed_token_ids=allowed),
            free,
        ],
    )
    assert set(outs[1].token_ids) <= set(allowed) and len(outs[1].token_ids) == 32
    assert outs[2].token_ids == llm.generate([prompt], free)[0].token_ids
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.model_config.model, dtype=torch.float32).eval()
    seq = list(prompt)
    for token in outs[0].token_ids:
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1]
        assert token == allowed[int(logits[allowed].argmax())]
        seq.append(token)
    eos = llm.executor.info.eos_token_ids[0]
    only_eos = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[eos]))
    assert only_eos[0].token_ids == [eos] * 3 and only_eos[0].finish_reason == "stop"


def test_bad_words_in_the_engine(llm: LLM) -> None:
    """vLLM's ``bad_words`` (as token sequences): greedy output follows the unconstrained one until
    a bad word would complete, then takes another token there; a one-token word never appears."""
    prompt = prompt_ids(llm, 10, seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free = llm.generate([prompt], params)[0].token_ids
    at = next(i for i in range(1, 9) if free[i] not in free[:i])  # a first occurrence
    word = free[at - 1 : at + 1]  # completes at output position ``at``
    params.bad_words_token_ids = [word]
    got = llm.generate([prompt], params)[0].token_ids
    assert got[:at] == free[:at] and got[at] != free[at]
    assert all(got[i : i + 2] != word for i in range(len(got) - 1))
    params.bad_words_token_ids = [[free[0]]]
    assert free[0] not in llm.generate([prompt], params)[0].token_ids
    # The word's first token alone in the prompt does not count: only the output is matched.
    params.bad_words_token_ids = [[prompt[-1], free[0]]]
    assert llm.generate([prompt], params)[0].token_ids == free


def test_contradictory_bans_give_up_min_tokens_first(llm: LLM) -> None:
    """allowed_token_ids = {EOS, x}, x a bad word, min_tokens 2: every allowed token is banned. The
    bad word holds and min_tokens gives way (EOS), rather than the row drawing from nothing."""
    prompt = prompt_ids(llm, 6, seed=5)
    eos, x = llm.executor.info.eos_token_ids[0], 42
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, allowed_token_ids=[eos, x], bad_words_token_ids=[[x]])
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == [eos, eos] and out.finish_reason == "stop"
