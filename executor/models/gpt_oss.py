"""gpt-oss: attention with sinks, biases and alternating sliding/full layers; experts with biases.

As transformers computes it: q/k/v/o biases; a per-head sink logit joins each attention softmax
(`Ops.paged_attention`'s ``sinks``); layers follow ``layer_types`` (released: even layers slide
over ``sliding_window`` keys, odd ones are full); YaRN rotary; every layer a mixture of experts
whose router has a bias and picks top-k on the raw logits, then softmaxes over the k chosen; the
experts have biases and the clamped SwiGLU (`Ops.fused_moe`'s ``swigluoai``).

The checkpoint stores experts stacked and input-major: ``experts.gate_up_proj`` ``[E, H, 2I]``
with gate and up *interleaved* (gate in the even columns), ``experts.down_proj`` ``[E, I, H]``;
they are de-interleaved and transposed here into `fused_moe`'s ``[E, 2I, H]`` / ``[E, H, I]``.
A tensor-parallel rank's intermediate slice ``[i0, i1)`` is the contiguous interleaved columns
``[2 i0, 2 i1)``. Unquantized (bf16/fp32) checkpoints only: released ones store the experts in
MXFP4, refused with a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from executor.layers.moe import Router
from executor.model_config import HFModelConfig
from executor.models.base import Shapes, ShardSpec, StateDict, rows, set_windows
from executor.models.moe_family import MoEConfig, MoEFamily, expert_count
from executor.ops import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

if TYPE_CHECKING:
    from executor.parallel import ShardLayout

GPT_OSS = "GptOssForCausalLM"


class GptOssFamily(MoEFamily):
    """gpt-oss (20b, 120b and their shapes), unquantized."""

    architectures = (GPT_OSS,)
    activation = "swigluoai"
    row_parallel_biases = ("self_attn.o_proj.bias", "mlp.experts.down_proj_bias")

    def moe_fields(self, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(
            num_experts=expert_count(raw),
            top_k=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            sparse_layers=[True] * num_layers,
        )

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        if quant := raw.get("quantization_config"):
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(
                f"{GPT_OSS} checkpoint is quantized ({method}); only unquantized bf16/fp32 gpt-oss checkpoints load "
                "(dequantize it first: transformers' Mxfp4Config(dequantize=True), then save_pretrained)"
            )
        alpha, limit = float(raw.get("swiglu_alpha", SWIGLUOAI_ALPHA)), float(raw.get("swiglu_limit", SWIGLUOAI_LIMIT))
        if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise ValueError(
                f"{GPT_OSS} with swiglu_alpha={alpha}, swiglu_limit={limit} is not supported "
                f"(the engine's clamped SwiGLU uses {SWIGLUOAI_ALPHA}, {SWIGLUOAI_LIMIT})"
            )
        cfg.attention_bias = cfg.o_bias = bool(raw.get("attention_bias", True))
        cfg.attn_sinks = True
        set_windows(cfg, raw, raw.get("sliding_window"), lambda i: i % 2 == 0)

    def router(self, cfg: MoEConfig) -> Router:
        return Router(cfg.top_k, "topk_softmax")

    def sparse_shapes(self, cfg: MoEConfig, m: str) -> Shapes:
        h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        x = m + "experts."
        return {
            m + "router.weight": (e, h),
            m + "router.bias": (e,),
            x + "gate_up_proj": (e, h, 2 * inter),
            x + "gate_up_proj_bias": (e, 2 * inter),
            x + "down_proj": (e, inter, h),
            x + "down_proj_bias": (e, h),
        }

    def fuse_sparse(self, cfg: MoEConfig, sd: StateDict, m: str, e: str) -> StateDict:
        x = m + "experts."
        gate_up, gate_up_bias = sd[x + "gate_up_proj"], sd[x + "gate_up_proj_bias"]
        return {
            e + "router": sd[m + "router.weight"],
            e + "router_bias": sd[m + "router.bias"],
            e + "w13": torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous(),
            e + "b13": torch.cat([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]], dim=-1),
            e + "w2": sd[x + "down_proj"].transpose(1, 2).contiguous(),
            e + "b2": sd[x + "down_proj_bias"],
        }

    def shard_spec(self, name: str, layout: ShardLayout) -> ShardSpec | None:
        i0, i1 = layout.expert_inter
        if name.endswith("mlp.experts.gate_up_proj"):
            return rows(2, (2 * i0, 2 * i1))
        if name.endswith("mlp.experts.gate_up_proj_bias"):
            return rows(1, (2 * i0, 2 * i1))
        if name.endswith("mlp.experts.down_proj"):
            return rows(1, (i0, i1))
        if name.endswith(("mlp.router.weight", "mlp.router.bias", "mlp.experts.down_proj_bias")):
            return None  # whole (the down bias on rank 0 only: `row_parallel_biases`)
        return super().shard_spec(name, layout)
