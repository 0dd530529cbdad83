"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's norms, scales and windows.

Both: RMSNorms scale by ``1 + w`` in fp32; sandwich norms (attention's and the MLP's outputs are
normed too); embeddings times ``sqrt(hidden)``; attention scale ``query_pre_attn_scalar ** -0.5``;
GeGLU (tanh); tied embeddings; interleaved sliding-window layers (the config's ``layer_types``, or
Gemma 2's every other layer / Gemma 3's five local to one global). Gemma 2 soft-caps attention
scores and output logits; Gemma 3 has (1 + w) q/k norms instead, and its sliding layers use their
own rotary base (``rope_parameters["sliding_attention"]``, or ``rope_local_base_freq``).
"""

from __future__ import annotations

from typing import Any

from executor.model_config import FULL, SLIDING, HFModelConfig, RopeParams, rope_params
from executor.models.base import ModelFamily, set_windows

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"


class GemmaFamily(ModelFamily):
    """Gemma 2 and Gemma 3 text (``gemma3_text`` configs)."""

    architectures = (GEMMA2, GEMMA3)

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        gemma3 = cfg.architecture == GEMMA3
        if gemma3 and raw.get("model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"{GEMMA3} needs a gemma3_text config, not {raw.get('model_type')!r} (multimodal Gemma 3)")
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported (a causal decoder only)")
        cfg.hidden_act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
        cfg.attention_bias = cfg.o_bias = bool(raw.get("attention_bias", False))
        cfg.gemma_norm = cfg.sandwich_norm = True
        cfg.embed_scale = cfg.hidden_size**0.5
        cfg.attn_scale = float(raw.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        # transformers' Gemma 3 attention never applies attn_logit_softcapping, whatever it says.
        cfg.attn_softcap = None if gemma3 else _float(raw.get("attn_logit_softcapping"))
        cfg.final_softcap = _float(raw.get("final_logit_softcapping"))
        cfg.tie_word_embeddings = bool(raw.get("tie_word_embeddings", True))
        if gemma3:
            cfg.qk_norm = True
            pattern = int(raw.get("sliding_window_pattern", 6))
            set_windows(cfg, raw, raw.get("sliding_window", 4096), lambda i: bool((i + 1) % pattern))
            glob = rope_params(raw, FULL, default_theta=1_000_000.0)
            cfg.rope_theta, cfg.rope_scaling = glob.theta, glob.scaling
            params = raw.get("rope_parameters")
            if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
                cfg.rope_local = rope_params(raw, SLIDING)
            else:
                cfg.rope_local = RopeParams(float(raw.get("rope_local_base_freq", 10_000.0)))
        else:
            set_windows(cfg, raw, raw.get("sliding_window", 4096), lambda i: i % 2 == 0)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
