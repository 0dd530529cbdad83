"""Parse a Llama-family ``config.json`` into the few numbers the engine's model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(slots=True)
class HFModelConfig:
    """Architecture of one checkpoint (Llama, Mistral, Qwen2 and Qwen3 share one decoder).

    ``rope_scaling`` is None or a dict with ``rope_type`` (``default`` or ``llama3``) and its
    parameters. ``qk_norm`` (Qwen3) is a per-head RMSNorm of q and k before RoPE.

    Biases, as transformers builds each architecture: ``attention_bias`` on q/k/v (Qwen2 always;
    Llama and Qwen3 when their ``attention_bias`` says so), ``o_bias`` on o_proj (Llama and Qwen3
    with ``attention_bias``; never Qwen2), ``mlp_bias`` on gate/up/down (Llama's ``mlp_bias``).
    Mistral has none, whatever its config says.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either the classic keys or transformers 5's
    ``rope_parameters`` (which folds theta into the same dict, possibly per layer type)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type parameters ({"full_attention": {...}}): these models use one type.
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, llama3)")
    scaling["rope_type"] = "llama3"
    return theta, scaling


def parse_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> HFModelConfig:
    """Build an `HFModelConfig` from parsed ``config.json`` (and ``generation_config.json``)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs!r}; supported: {SUPPORTED_ARCHITECTURES}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope(cfg)
    # Sliding windows are not implemented: refuse a checkpoint that would need one.
    window = cfg.get("sliding_window")
    if window is not None and (arch in ("MistralForCausalLM", "LlamaForCausalLM") or cfg.get("use_sliding_window")):
        if int(window) < int(cfg.get("max_position_embeddings", 0)):
            raise ValueError(f"sliding_window={window} is not supported")
    # Which projections carry biases follows each transformers model class (see HFModelConfig).
    attn_bias_flag = bool(cfg.get("attention_bias", False))
    qkv_bias = arch == "Qwen2ForCausalLM" or (arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attn_bias_flag)
    o_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attn_bias_flag
    mlp_bias = arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False))
    gen = generation_config or {}
    eos = _as_id_list(gen.get("eos_token_id")) or _as_id_list(cfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    return HFModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        o_bias=o_bias,
        mlp_bias=mlp_bias,
    )


def load_config(model_dir: str | Path) -> HFModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present) from ``model_dir``."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    cfg = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_config(cfg, gen)
