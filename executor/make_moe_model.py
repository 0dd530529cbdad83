"""Small random mixture-of-experts checkpoints, built with transformers' own classes.

`executor.make_model` writes the dense families' tensors by hand; the MoE families' checkpoint
layouts differ more (per-expert tensors for Qwen2-MoE, Qwen3-MoE and Mixtral; gpt-oss's stacked,
transposed and interleaved experts with biases and its attention sinks), so these are built by
transformers' config and model classes and written with ``save_pretrained``: the files are
exactly what transformers saves. Weights are then re-drawn for *decisive* greedy decoding as
`executor.make_model` does (a large output-head std; residual outputs amplified), with routers
at O(1) logits so top-k choices are never near ties.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

# Architecture -> (config class, model class), by transformers' names.
MOE_ARCHS: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}

# Geometry per size: experts, top-k and the expert width beside the dense fields.
MOE_GEOMETRY: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab=1024,
        hidden=64,
        layers=3,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=8,
        top_k=2,
        moe_inter=32,
        inter=96,
        shared_inter=48,
        max_pos=2048,
        window=16,
    ),  # fmt: skip
    "small": dict(
        vocab=8192,
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=4,
        head_dim=64,
        experts=8,
        top_k=2,
        moe_inter=512,
        inter=1024,
        shared_inter=512,
        max_pos=4096,
        window=128,
    ),  # fmt: skip
}


def moe_config(arch: str, size: str, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """Keyword arguments of ``arch``'s transformers config class for ``size``.

    Every family's distinguishing options are on: Qwen3-MoE renormalises its top-k and has a
    dense layer (``mlp_only_layers``); Qwen2-MoE a shared expert and no renormalisation;
    gpt-oss alternating sliding/full layers with a window shorter than the tests' prompts.
    """
    g = MOE_GEOMETRY[size]
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=g["hidden"],
        num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        max_position_embeddings=g["max_pos"],
        num_experts_per_tok=g["top_k"],
        tie_word_embeddings=False,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
    )
    if arch == "qwen3_moe":
        kw.update(num_experts=g["experts"], moe_intermediate_size=g["moe_inter"], intermediate_size=g["inter"],
                  norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, rope_theta=10000.0)  # fmt: skip
    elif arch == "qwen2_moe":
        kw.update(num_experts=g["experts"], moe_intermediate_size=g["moe_inter"], intermediate_size=g["inter"],
                  shared_expert_intermediate_size=g["shared_inter"], norm_topk_prob=False, rope_theta=10000.0)  # fmt: skip
    elif arch == "mixtral":
        kw.update(num_local_experts=g["experts"], intermediate_size=g["moe_inter"], rope_theta=10000.0)
    elif arch == "gpt_oss":
        kw.update(num_local_experts=g["experts"], intermediate_size=g["moe_inter"], sliding_window=g["window"],
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(g["layers"])])  # fmt: skip
        # Released gpt-oss's YaRN, with an original context of max_pos / factor: the scaled and
        # interpolated frequency bands both matter at test lengths.
        kw["rope_parameters"] = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                     truncate=False, original_max_position_embeddings=g["max_pos"] // 32)  # fmt: skip
    else:
        raise ValueError(f"unknown MoE arch {arch!r}; expected one of {tuple(MOE_ARCHS)}")
    return kw


def _redraw(model: torch.nn.Module, hidden: int, seed: int, head_gain: float, out_gain: float, special_ids: list[int]) -> None:
    """Re-draw every parameter (see the module docstring) by its transformers name."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or "layernorm" in name:
                # Random signs on the final norm (as `executor.make_model`): tokens do not repeat.
                w = 1.0 + normal(p.shape, 0.1)
                if name == "model.norm.weight":
                    w = w * (torch.randint(0, 2, p.shape, generator=gen) * 2.0 - 1.0)
                p.copy_(w)
            elif name == "model.embed_tokens.weight":
                p.copy_(normal(p.shape, 1.0))
            elif name == "lm_head.weight":
                w = normal(p.shape, head_gain / math.sqrt(hidden))
                w[special_ids] *= 0.1  # greedy decoding never emits EOS by chance
                p.copy_(w)
            elif leaf == "sinks":
                p.copy_(normal(p.shape, 1.0))
            elif "bias" in leaf:
                p.copy_(normal(p.shape, 0.1))
            elif name.endswith("experts.gate_up_proj") and p.dim() == 3 and p.shape[1] == hidden:  # gpt-oss [E, H, 2I]
                p.copy_(normal(p.shape, 1.0 / math.sqrt(hidden)))
            elif name.endswith("experts.down_proj") and p.dim() == 3 and p.shape[2] == hidden:  # gpt-oss [E, I, H]
                p.copy_(normal(p.shape, out_gain / math.sqrt(int(p.shape[1]))))
            else:  # [out, in] or stacked [E, out, in]: std gain / sqrt(fan_in)
                out_proj = any(s in name for s in ("o_proj", "down_proj", ".w2"))
                p.copy_(normal(p.shape, (out_gain if out_proj else 1.0) / math.sqrt(p.shape[-1])))


def write_moe_checkpoint(arch: str, size: str, seed: int, out: Path, ids: dict[str, int], vocab_size: int) -> None:
    """Write ``arch``'s config and random weights into ``out`` with ``save_pretrained`` (fp32)."""
    import transformers

    from executor.make_model import HEAD_GAIN, OUT_GAIN

    cfg_name, model_name = MOE_ARCHS[arch]
    config = getattr(transformers, cfg_name)(**moe_config(arch, size, vocab_size, ids))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    _redraw(model, config.hidden_size, seed, HEAD_GAIN, OUT_GAIN, list(ids.values()))
    model.save_pretrained(str(out))
    for path in out.glob("*.safetensors"):  # readable by a service running as another user
        path.chmod(0o644)
    # `executor.make_model` writes generation_config.json itself (the same for every family).
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2))
