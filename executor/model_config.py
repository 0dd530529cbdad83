"""The engine's view of a checkpoint's ``config.json``: one dataclass every model family fills.

Which family reads a config is decided by its ``architectures`` (`executor.models.registry`); the
family parses what differs (`executor.models.base.ModelFamily.parse`), and the fields every
decoder shares are read here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(slots=True)
class RopeParams:
    """Rotary embedding of one layer type: ``theta`` and ``scaling`` (None: plain RoPE; else a
    dict with ``rope_type`` in default/linear/dynamic/llama3/yarn/longrope and its parameters)."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(slots=True)
class HFModelConfig:
    """Architecture of one checkpoint, as the shared layers (`executor.layers`) need it.

    Biases, as transformers builds each architecture: ``attention_bias`` on q/k/v, ``o_bias`` on
    o_proj, ``mlp_bias`` on the MLP's projections. ``qk_norm``: a per-head RMSNorm of q and k
    before RoPE (Qwen3, Gemma 3).

    Per layer: ``layer_types[i]`` is ``full_attention`` or ``sliding_attention`` (which then sees
    the last ``sliding_window`` keys, itself included); ``rope_local`` is the rotary of sliding
    layers when it differs from the global one (Gemma 3's local base frequency).

    Gemma: ``gemma_norm`` (norms scale by ``1 + w``, in fp32), ``sandwich_norm`` (norms after
    attention and the MLP too), ``embed_scale`` (embeddings times it), ``attn_scale`` (instead of
    ``head_dim ** -0.5``), ``attn_softcap``/``final_softcap`` (``c * tanh(x / c)`` of attention
    scores / output logits). ``attn_sinks``: a per-head sink logit joins each softmax (gpt-oss).
    Families with more (a mixture of experts) subclass this dataclass.
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
    layer_types: list[str] = field(default_factory=list)  # empty: every layer full attention
    sliding_window: int | None = None
    rope_local: RopeParams | None = None
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    gemma_norm: bool = False
    sandwich_norm: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_sinks: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The sliding window every layer shares (KV behind it is never read again), or None."""
        windows = {self.window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def rope(self, layer: int) -> RopeParams:
        """The rotary parameters of ``layer`` (its type's)."""
        if self.rope_local is not None and self.window(layer) is not None:
            return self.rope_local
        return RopeParams(self.rope_theta, self.rope_scaling)

    @property
    def scale(self) -> float:
        """The attention softmax scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_params(cfg: dict[str, Any], layer_type: str = FULL, default_theta: float = 10000.0) -> RopeParams:
    """A layer type's `RopeParams` from the classic keys (``rope_theta``, ``rope_scaling``) or
    transformers 5's ``rope_parameters`` (theta folded in, possibly keyed by layer type)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type) or params.get(FULL) or next(iter(params.values()))
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta = float(cfg.get("rope_theta", default_theta))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else {}
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)
    if rope_type == "default":
        return RopeParams(theta, None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    scaling["rope_type"] = rope_type
    if rope_type in ("yarn", "longrope", "dynamic", "llama3"):
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return RopeParams(theta, scaling)


def partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """``partial_rotary_factor`` from the top level or (transformers 5) ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(cfg.get("partial_rotary_factor", 1.0))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def base_config(arch: str, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> HFModelConfig:
    """The fields every family reads the same way, from parsed ``config.json`` (and
    ``generation_config.json``); a family's `parse` adjusts the rest (biases, windows, norms)."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = rope_params(cfg)
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
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        partial_rotary_factor=partial_rotary_factor(cfg),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
    )


def parse_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> HFModelConfig:
    """Build an `HFModelConfig` from parsed ``config.json`` by the family of its architecture."""
    from executor.models.registry import family_for

    arch, family = family_for(cfg.get("architectures") or [])
    return family.parse(arch, cfg, generation_config)


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
