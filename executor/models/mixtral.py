"""Mixtral: the Mistral decoder with a sparse block of softmax-top-k experts on every layer.

The router's softmax (fp32, over all experts) is followed by top-k and always renormalised (the
same as a softmax over the k chosen logits); the weights stay fp32. Checkpoint names:
``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{j}.w1/w3/w2`` (gate, up, down).
``sliding_window`` (when set) applies to every layer.
"""

from __future__ import annotations

from typing import Any

from executor.layers.mlp import SILU
from executor.layers.moe import Router
from executor.model_config import HFModelConfig
from executor.models.base import set_windows
from executor.models.moe_family import MoEConfig, MoEFamily, expert_count

MIXTRAL = "MixtralForCausalLM"


class MixtralFamily(MoEFamily):
    """Mixtral (8x7B, 8x22B and their shapes)."""

    architectures = (MIXTRAL,)
    moe_module = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")

    def moe_fields(self, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(
            num_experts=expert_count(raw),
            top_k=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            renormalize=True,
            sparse_layers=[True] * num_layers,
        )

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        if cfg.hidden_act not in SILU:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} for {MIXTRAL}")
        set_windows(cfg, {}, raw.get("sliding_window"), lambda i: True)

    def router(self, cfg: MoEConfig) -> Router:
        return Router(cfg.top_k, "softmax", renormalize=True)
