"""Phi-3: the Llama decoder with fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint.

``qkv_proj`` rows are ``[Q | K | V]`` and ``gate_up_proj`` rows ``[gate | up]``: already the
engine's fused layout, so they load as they are; a tensor-parallel rank reads its rows of each
part. ``sliding_window`` (when set) applies to every layer; rotary may be partial and LongRoPE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from executor.layers.mlp import SILU
from executor.model_config import HFModelConfig
from executor.models.base import ModelFamily, Shapes, ShardSpec, StateDict, rows, set_windows

if TYPE_CHECKING:
    from executor.parallel import ShardLayout

PHI3 = "Phi3ForCausalLM"


class Phi3Family(ModelFamily):
    """Phi-3 (mini, small context and long-context LongRoPE variants)."""

    architectures = (PHI3,)

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        if cfg.hidden_act not in SILU:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} for {PHI3}")
        set_windows(cfg, {}, raw.get("sliding_window"), lambda i: True)

    def attention_shapes(self, cfg: HFModelConfig, layer: int, a: str) -> Shapes:
        h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        return {a + "qkv_proj.weight": (q + 2 * kv, h), a + "o_proj.weight": (h, q)}

    def mlp_shapes(self, cfg: HFModelConfig, layer: int, m: str) -> Shapes:
        h, inter = cfg.hidden_size, cfg.intermediate_size
        return {m + "gate_up_proj.weight": (2 * inter, h), m + "down_proj.weight": (h, inter)}

    def fuse_attention(self, cfg: HFModelConfig, layer: int, sd: StateDict, a: str, e: str) -> StateDict:
        return {e + "qkv": sd[a + "qkv_proj.weight"], e + "o": sd[a + "o_proj.weight"]}

    def fuse_mlp(self, cfg: HFModelConfig, layer: int, sd: StateDict, m: str, e: str) -> StateDict:
        return {e + "gate_up": sd[m + "gate_up_proj.weight"], e + "down": sd[m + "down_proj.weight"]}

    def shard_spec(self, name: str, layout: ShardLayout) -> ShardSpec | None:
        if name.endswith("self_attn.qkv_proj.weight"):
            (q0, q1), (k0, k1) = layout.q_rows(), layout.kv_rows()
            q, kv = layout.q_size, layout.kv_size
            return rows(0, (q0, q1), (q + k0, q + k1), (q + kv + k0, q + kv + k1))
        if name.endswith("mlp.gate_up_proj.weight"):
            i0, i1 = layout.inter
            return rows(0, (i0, i1), (layout.inter_size + i0, layout.inter_size + i1))
        return super().shard_spec(name, layout)
