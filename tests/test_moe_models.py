"""The mixture-of-experts families end to end, with transformers as the oracle.

Each tiny checkpoint is built by transformers' own classes (`executor.make_moe_model`) with every
family option on: Qwen3-MoE renormalised top-k, q/k norm and a dense layer; Qwen2-MoE shared
expert, no renormalisation, q/k/v biases; Mixtral; gpt-oss sinks, alternating 16-token windows
(shorter than most prompts), YaRN, biased experts with the clamped SwiGLU. The offline engine's
greedy tokens must equal transformers' ``generate`` on the same checkpoint with chunked prefill,
prefix caching, preemption, async scheduling and tensor parallel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common import SamplingParams
from executor.model_config import parse_config
from executor.models.moe_family import MoEConfig
from gateway.llm import LLM
from tests.test_engine import hf_greedy, random_prompts

pytestmark = pytest.mark.model

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]
MAX_TOKENS = 10


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_parity_with_transformers(tiny_model, arch: str) -> None:
    """Chunked prefills beside decodes (a 48-token budget), then the same prompts again: the
    second run reads the prompts from the prefix cache and must give the same tokens."""
    model_dir = tiny_model(arch)
    llm = LLM(model_dir, dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=8)
    prompts = random_prompts(llm.executor.info.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    assert llm.scheduler.num_steps > MAX_TOKENS + 5, "the budget should have split prefills across steps"
    hits_before = llm.scheduler.prefix_cache_hits
    again = llm.generate(prompts, params)
    assert llm.scheduler.prefix_cache_hits > hits_before
    hf = _hf(model_dir)
    for prompt, out, out2 in zip(prompts, outputs, again):
        want, hf_logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.token_ids == want, f"{arch}: prompt of {len(prompt)} tokens diverged"
        assert out2.token_ids == want, f"{arch}: prompt of {len(prompt)} tokens diverged with prefix caching"
        for step, lp in enumerate(out.logprobs or []):
            assert lp is not None
            for token, value in lp.items():
                assert abs(value - hf_logprobs[step, token].item()) < 1e-3
    llm.cache_manager.check_invariants()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_preemption_and_async_scheduling_match_transformers(tiny_model, arch: str) -> None:
    """Too few KV blocks for all requests (preemptions, recomputed prefills), async scheduling on."""
    model_dir = tiny_model(arch)
    prompts = random_prompts(1000, seed=1)[2:]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model_dir, block_size=16, max_num_batched_tokens=128, num_blocks=30, max_model_len=480, async_scheduling=True)
    got = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions > 0
    hf = _hf(model_dir)
    for prompt, out in zip(prompts, got):
        assert out.token_ids == hf_greedy(hf, prompt, 16)[0], f"{arch}: prompt of {len(prompt)} tokens diverged"
    llm.cache_manager.check_invariants()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen2_moe", "mixtral"])
def test_tp2_parity(tiny_model, arch: str) -> None:
    """tensor_parallel_size=2 (gloo): per-expert sharding (each expert's intermediate dim split),
    the shared expert sharded likewise, gpt-oss's interleaved experts, sinks and biases."""
    model_dir = tiny_model(arch)
    options = dict(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=8, num_threads=1)
    llm = LLM(model_dir, tensor_parallel_size=2, **options)
    try:
        prompts = random_prompts(llm.executor.info.vocab_size)[:8]
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        hf = _hf(model_dir)
        for prompt, out in zip(prompts, got):
            assert out.token_ids == hf_greedy(hf, prompt, 8)[0], f"{arch}: prompt of {len(prompt)} tokens diverged"
        llm.cache_manager.check_invariants()
    finally:
        llm.shutdown()


def _raw(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_config_reads_each_familys_expert_geometry(tiny_model) -> None:
    q3 = parse_config(_raw(tiny_model("qwen3_moe")))
    assert isinstance(q3, MoEConfig)
    assert (q3.num_experts, q3.top_k, q3.renormalize, q3.qk_norm) == (8, 2, True, True)
    assert q3.sparse_layers == [True, False, True]  # mlp_only_layers=[1]
    assert q3.shared_expert_intermediate_size == 0
    q2 = parse_config(_raw(tiny_model("qwen2_moe")))
    assert isinstance(q2, MoEConfig)
    assert (q2.renormalize, q2.attention_bias, q2.o_bias, q2.shared_expert_intermediate_size) == (False, True, False, 48)
    raw = _raw(tiny_model("qwen2_moe"))
    raw.update(decoder_sparse_step=2, mlp_only_layers=[])
    stepped = parse_config(raw)
    assert isinstance(stepped, MoEConfig) and stepped.sparse_layers == [False, True, False]
    oss = parse_config(_raw(tiny_model("gpt_oss")))
    assert isinstance(oss, MoEConfig)
    assert oss.attn_sinks and oss.attention_bias and oss.o_bias
    assert [oss.window(i) for i in range(3)] == [16, None, 16]
    assert oss.rope_scaling is not None and oss.rope_scaling["rope_type"] == "yarn"


def test_gpt_oss_refuses_mxfp4_and_other_swiglu_constants(tiny_model) -> None:
    raw = _raw(tiny_model("gpt_oss"))
    with pytest.raises(ValueError, match="quantized \\(mxfp4\\).*unquantized"):
        parse_config({**raw, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="swiglu_limit=5.0"):
        parse_config({**raw, "swiglu_limit": 5.0})


def test_tensor_parallel_layout_splits_each_expert(tiny_model) -> None:
    """Per-expert TP: each rank holds its slice of every expert's (and the shared expert's)
    intermediate dim; a split that does not divide them is refused before any process starts."""
    from executor.parallel import ShardLayout

    cfg = parse_config(_raw(tiny_model("qwen2_moe")))  # moe_intermediate 32, shared 48
    assert [ShardLayout.build(cfg, r, 2).expert_inter for r in range(2)] == [(0, 16), (16, 32)]
    assert [ShardLayout.build(cfg, r, 2).shared_inter for r in range(2)] == [(0, 24), (24, 48)]
    raw = _raw(tiny_model("qwen2_moe"))
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        ShardLayout.build(parse_config({**raw, "moe_intermediate_size": 33}), 0, 2)
