"""The model families beyond plain Llama, token-exact against transformers on greedy decoding.

Each checkpoint is a tiny random one that transformers' own classes built (`executor.make_model`),
with its windows shorter than the longer prompts. The engine runs them through the offline `LLM`
with prefix caching (a repeated prompt hits), chunked prefill, preemption (few KV blocks) and
async scheduling all on; transformers (eager attention) is the oracle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from common import SamplingParams
from gateway.llm import LLM
from tests.test_engine import hf_greedy

pytestmark = pytest.mark.model

MAX_TOKENS = 12
PROMPT_LENS = (3, 17, 40, 70, 101)
WINDOW = 12  # Mistral/Qwen2/Phi-3 variants: every prompt but the first runs past it
# (arch, sliding_window): gemma2/gemma3 alternate window-16 and full layers by default.
FAMILIES = [("gemma2", None), ("gemma3", None), ("phi3", None), ("phi3", WINDOW), ("mistral", WINDOW), ("qwen2", WINDOW)]
IDS = ["gemma2", "gemma3", "phi3", "phi3-window", "mistral-window", "qwen2-window"]
# Few blocks: 5 prompts need 24 of 16 tokens; 11 (at most max_model_len=176) force preemptions.
ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32, max_num_seqs=8)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def hf_model(path: Path, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager", **overrides).eval()


def assert_greedy_matches(got: list[int], got_lps: list[dict[int, float]] | None, want: list[int], ref: torch.Tensor) -> None:
    """Engine tokens equal transformers' (``ref``: its logprobs per step); where they first differ,
    the two tokens must tie in transformers' logprobs (vLLM's rule), and the rest is not compared.
    The engine's top logprobs match transformers' wherever the tokens agree."""
    for j, (a, b) in enumerate(zip(got, want)):
        if a != b:
            gap = float(ref[j, b] - ref[j, a])
            assert gap < 1e-4, f"token {j}: engine {a} vs transformers {b}, logprob gap {gap:.3g}"
            return
        if got_lps is not None:
            for t, lp in got_lps[j].items():
                assert abs(lp - float(ref[j, t])) < 1e-3, (j, t, lp, float(ref[j, t]))
    assert len(got) == len(want)


@pytest.mark.parametrize("arch, window", FAMILIES, ids=IDS)
def test_greedy_parity_with_transformers(tiny_model, arch: str, window: int | None) -> None:
    path = tiny_model(arch, sliding_window=window)
    llm = LLM(path, num_blocks=11, max_model_len=176, **ENGINE)
    vocab = llm.executor.info.vocab_size
    ps = prompts(vocab)
    info = llm.executor.info
    if info.sliding_window is not None or info.kv_group_windows:  # blocks behind a window freed: more load to preempt
        ps += prompts(vocab, seed=1) + prompts(vocab, seed=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(ps, params)
    assert llm.scheduler.num_preemptions > 0, "few blocks should have preempted a request"
    again = llm.generate([ps[-1]], params)[0]  # its prompt's blocks are cached: a prefix hit
    assert llm.scheduler.prefix_cache_hits > 0
    hf = hf_model(path)
    for prompt, out in zip(ps, outs):
        want, ref = hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_matches(out.token_ids, out.logprobs, want, ref)
    assert again.token_ids == outs[-1].token_ids
    llm.cache_manager.check_invariants()


@pytest.mark.parametrize(
    "arch, window, override",
    [
        ("gemma2", None, dict(sliding_window=4096)),
        ("gemma2", None, dict(attn_logit_softcapping=None)),
        ("gemma2", None, dict(final_logit_softcapping=None)),
        ("gemma3", None, dict(sliding_window=4096)),
        ("mistral", WINDOW, dict(sliding_window=4096)),
        ("qwen2", WINDOW, dict(sliding_window=4096)),
    ],
)
def test_the_features_matter(tiny_model, arch: str, window: int | None, override: dict) -> None:
    """Without its window (or soft-cap) transformers' own output changes: the parity above is not
    vacuous for that feature."""
    path = tiny_model(arch, sliding_window=window)
    ids = torch.tensor([prompts(1000, seed=3)[-1]])
    with torch.no_grad():
        a = hf_model(path)(ids).logits
        b = hf_model(path, **override)(ids).logits
    assert (a - b).abs().max() > 0.05


def test_gemma_runs_in_bfloat16(tiny_model) -> None:
    """Gemma's norms scale by (1 + w) in fp32 before the cast (`executor.layers.norm.RMSNorm`):
    in bf16 the first token's logprobs stay close to transformers' fp32 ones."""
    path = tiny_model("gemma3")
    llm = LLM(path, **dict(ENGINE, dtype="bfloat16"))
    prompt = prompts(1000, seed=4)[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    _, ref = hf_greedy(hf_model(path), prompt, 1)
    assert out.logprobs is not None
    for t, lp in out.logprobs[0].items():
        assert abs(lp - float(ref[0, t])) < 0.3


def test_make_model_writes_what_transformers_builds(tiny_model) -> None:
    """The new families' checkpoints are real transformers ones: loaded with no key missing or
    unexpected, and parsed by the engine into the per-layer windows and rotary they declare."""
    from transformers import AutoModelForCausalLM

    from executor.model_config import FULL, SLIDING, load_config

    for arch in ("gemma2", "gemma3", "phi3"):
        path = tiny_model(arch)
        _, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], arch
    g3 = load_config(tiny_model("gemma3"))
    assert g3.layer_types == [SLIDING, FULL] and g3.window(0) == 16 and g3.window(1) is None
    assert g3.rope(0).theta == 10000.0 and g3.rope(0).scaling is None
    assert g3.rope(1).scaling is not None and g3.rope(1).scaling["rope_type"] == "linear"
    assert g3.qk_norm and g3.gemma_norm and g3.sandwich_norm and g3.attn_scale == 24**-0.5
    g2 = load_config(tiny_model("gemma2"))
    assert (g2.attn_softcap, g2.final_softcap) == (2.0, 20.0) and not g2.qk_norm
    phi = load_config(tiny_model("phi3"))
    assert phi.partial_rotary_factor == 0.5 and phi.rope_scaling is not None and phi.rope_scaling["rope_type"] == "longrope"
    qwen = load_config(tiny_model("qwen2", sliding_window=WINDOW))
    assert [qwen.window(i) for i in range(2)] == [None, WINDOW]  # max_window_layers=1


def test_classic_configs_read_as_transformers_reads_them() -> None:
    """Configs in the keys released checkpoints use (no ``layer_types``, no ``rope_parameters``):
    the engine's layer types, windows and rotary bases are transformers' own reading of them."""
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    from executor.model_config import SLIDING, parse_config

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    gemma3 = dict(
        base,
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        head_dim=16,
        num_hidden_layers=12,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=6,
        max_position_embeddings=32768,
    )
    qwen2 = dict(
        base,
        architectures=["Qwen2ForCausalLM"],
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=2,
        max_position_embeddings=4096,
    )
    mistral = dict(
        base, architectures=["MistralForCausalLM"], num_hidden_layers=3, sliding_window=64, max_position_embeddings=4096
    )
    for raw, cls in ((gemma3, Gemma3TextConfig), (qwen2, Qwen2Config), (mistral, MistralConfig)):
        ours, theirs = parse_config(raw), cls(**raw)
        n = ours.num_layers
        sliding = [ours.window(i) is not None for i in range(n)]
        types = getattr(theirs, "layer_types", None) or [SLIDING] * n  # Mistral: every layer
        assert sliding == [t == SLIDING for t in types], raw["architectures"]
        assert {ours.window(i) for i in range(n)} - {None} == {theirs.sliding_window}
    g3 = parse_config(gemma3)
    hf3 = Gemma3TextConfig(**gemma3).rope_parameters
    assert g3.rope(5).theta == hf3["full_attention"]["rope_theta"] and g3.rope(5).scaling["factor"] == 8.0
    assert g3.rope(0).theta == hf3["sliding_attention"]["rope_theta"] and g3.rope(0).scaling is None


def test_unsupported_architecture_lists_the_supported(tmp_path) -> None:
    from executor.model_config import load_config
    from executor.models.registry import SUPPORTED_ARCHITECTURES

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"unsupported architectures \['FalconForCausalLM'\]; supported: .*Gemma3ForCausalLM"):
        load_config(tmp_path)
    assert {"LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


def _tp_parity(path: Path) -> None:
    options = dict(ENGINE, max_num_batched_tokens=48, num_threads=1)
    tp = LLM(path, tensor_parallel_size=2, **options)
    try:
        ps = prompts(tp.executor.info.vocab_size, seed=1)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
        outs = tp.generate(ps, params)
        hf = hf_model(path)
        for prompt, out in zip(ps, outs):
            want, ref = hf_greedy(hf, prompt, 8)
            assert_greedy_matches(out.token_ids, out.logprobs, want, ref)
        tp.cache_manager.check_invariants()
    finally:
        tp.shutdown()


@pytest.mark.parametrize(
    "arch, window", [("gemma3", None), ("mistral", WINDOW), ("phi3", None)], ids=["gemma3", "mistral-window", "phi3"]
)
def test_tp2_parity(tiny_model, arch: str, window: int | None) -> None:
    """Tensor parallel over 2 CPU ranks (gloo): Gemma 3's q/k norms and local rotary, a window,
    and Phi-3's fused checkpoint projections, each rank reading its rows of every part."""
    _tp_parity(tiny_model(arch, sliding_window=window))
