"""Qwen2-MoE and Qwen3-MoE: the Qwen decoders with mixture-of-experts feed-forward blocks.

Both route with a softmax over all experts in fp32, then top-k; Qwen3-MoE divides the k weights
by their sum when ``norm_topk_prob`` (its released checkpoints do), Qwen2-MoE as its config says
(off by default); both round the weights to the model dtype. Layer ``i`` is sparse unless it is
in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a dense MLP of width
``intermediate_size``). Qwen2-MoE adds a shared expert behind a sigmoid gate and has q/k/v
biases (``qkv_bias``, never on o_proj); Qwen3-MoE has per-head q/k norms and, with
``attention_bias``, biases on q/k/v/o.
"""

from __future__ import annotations

from typing import Any

from executor.layers.mlp import SILU
from executor.layers.moe import Router
from executor.model_config import HFModelConfig
from executor.models.base import set_windows
from executor.models.moe_family import MoEConfig, MoEFamily, expert_count

QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"


class QwenMoEFamily(MoEFamily):
    """Qwen2-MoE (shared expert) and Qwen3-MoE (q/k norm)."""

    architectures = (QWEN2_MOE, QWEN3_MOE)

    def moe_fields(self, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
        num_experts = expert_count(raw)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        return dict(
            num_experts=num_experts,
            top_k=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            sparse_layers=[i not in dense and (i + 1) % step == 0 for i in range(num_layers)],
            renormalize=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        )

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        arch = cfg.architecture
        if cfg.hidden_act not in SILU:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} for {arch}")
        c = self.moe(cfg)
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        if arch == QWEN2_MOE:
            if not c.shared_expert_intermediate_size:
                raise ValueError(f"{arch} config has no shared_expert_intermediate_size")
            cfg.attention_bias = bool(raw.get("qkv_bias", True))
            first = int(raw.get("max_window_layers", cfg.num_layers))
            set_windows(cfg, raw, window, lambda i: i % 2 == 0 and i < first)
        else:
            c.shared_expert_intermediate_size = 0  # Qwen3-MoE has none, whatever the config says
            flag = bool(raw.get("attention_bias", False))
            cfg.attention_bias = cfg.o_bias = flag
            cfg.qk_norm = True
            set_windows(cfg, {}, window, lambda i: True)  # every layer slides when one does

    def router(self, cfg: MoEConfig) -> Router:
        return Router(cfg.top_k, "softmax", renormalize=cfg.renormalize, round_to_model_dtype=True)
