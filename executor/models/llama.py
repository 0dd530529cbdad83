"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 share one decoder (the `ModelFamily` defaults).

What differs is read from the config as transformers builds each class: biases (Qwen2 always has
q/k/v biases and never an o_proj one; Llama and Qwen3 have q/k/v/o biases with
``attention_bias``; Llama's ``mlp_bias``; Mistral none whatever its config says), Qwen3's q/k
norms, and sliding windows (Mistral: every layer when ``sliding_window`` is set; Qwen2/Qwen3: with
``use_sliding_window``, the layers from ``max_window_layers`` on, or the config's
``layer_types``).
"""

from __future__ import annotations

from typing import Any

from executor.layers.mlp import SILU
from executor.model_config import HFModelConfig
from executor.models.base import ModelFamily, set_windows

LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"


class LlamaFamily(ModelFamily):
    """Llama, Mistral, Qwen2, Qwen3."""

    architectures = (LLAMA, MISTRAL, QWEN2, QWEN3)

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        arch = cfg.architecture
        if cfg.hidden_act not in SILU:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} for {arch}")
        flag = bool(raw.get("attention_bias", False))
        cfg.attention_bias = arch == QWEN2 or (arch in (LLAMA, QWEN3) and flag)
        cfg.o_bias = arch in (LLAMA, QWEN3) and flag
        cfg.mlp_bias = arch == LLAMA and bool(raw.get("mlp_bias", False))
        cfg.qk_norm = arch == QWEN3
        if arch == MISTRAL:
            set_windows(cfg, {}, raw.get("sliding_window"), lambda i: True)
        elif arch in (QWEN2, QWEN3):
            first = int(raw.get("max_window_layers", cfg.num_layers))
            window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
            set_windows(cfg, raw, window, lambda i: i >= first)
        else:
            set_windows(cfg, raw, None, lambda i: False)
