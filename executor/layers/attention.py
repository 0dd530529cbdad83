"""Self-attention over the paged KV cache, with everything the families vary per layer.

Fused QKV projection (optional biases), optional per-head q/k norm (plain or Gemma's), rotary on
the first ``rot_dim`` channels, then `Ops.paged_attention` with this layer's sliding window,
attention sinks and logit soft-cap, and the output projection (all-reduced under tensor
parallelism: each rank holds its heads' rows of ``o``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from executor.attention_metadata import AttentionMetadata
from executor.layers.linear import Linear
from executor.layers.norm import RMSNorm
from executor.layers.weights import Weights
from executor.model_config import HFModelConfig
from executor.ops import Ops

if TYPE_CHECKING:
    from executor.parallel import TensorParallel


class Attention:
    """One layer's attention; ``cfg`` is the rank's local view (its heads) under tensor parallelism.

    Engine weight names under ``prefix``: ``qkv``, ``qkv_bias``?, ``o``, ``o_bias``?,
    ``q_norm``?/``k_norm``? and ``sinks``? (fp32 ``[Hq]``).
    """

    __slots__ = ("qkv", "o", "q_norm", "k_norm", "cos_sin", "ops", "tp", "hq", "hkv", "d", "scale", "extra")

    def __init__(
        self,
        cfg: HFModelConfig,
        layer: int,
        w: Weights,
        ops: Ops,
        cos_sin: torch.Tensor,
        tp: TensorParallel | None,
        prefix: str,
    ) -> None:
        self.qkv = Linear(w.take(prefix + "qkv"), w.opt(prefix + "qkv_bias"))
        self.o = Linear(w.take(prefix + "o"), w.opt(prefix + "o_bias"))
        q_norm, k_norm = w.opt(prefix + "q_norm"), w.opt(prefix + "k_norm")
        self.q_norm = None if q_norm is None else RMSNorm(q_norm, cfg.rms_norm_eps, ops, cfg.gemma_norm)
        self.k_norm = None if k_norm is None else RMSNorm(k_norm, cfg.rms_norm_eps, ops, cfg.gemma_norm)
        self.cos_sin, self.ops, self.tp = cos_sin, ops, tp
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.scale
        # Only what the layer uses travels to the op: a plain layer makes the plain call.
        extra: dict[str, Any] = {}
        if (window := cfg.window(layer)) is not None:
            extra["sliding_window"] = window
        if (sinks := w.opt(prefix + "sinks")) is not None:
            extra["sinks"] = sinks.float()
        if cfg.attn_softcap is not None:
            extra["softcap"] = cfg.attn_softcap
        self.extra = extra

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output ``[T, hidden]`` of the batch rows ``x`` (their K/V written to the cache)."""
        ops, t, hq, hkv, d = self.ops, x.shape[0], self.hq, self.hkv, self.d
        qkv = self.qkv(x)
        q_end, k_end = hq * d, (hq + hkv) * d
        q = qkv[:, :q_end].view(t, hq, d)
        k = qkv[:, q_end:k_end].view(t, hkv, d)
        v = qkv[:, k_end:].view(t, hkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.heads(q), self.k_norm.heads(k)
        ops.rotary(q, k, positions, self.cos_sin)
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, **self.extra)
        out: torch.Tensor = self.o(attn.reshape(t, hq * d))
        if self.tp is not None:  # row-parallel: each rank holds a partial sum
            self.tp.all_reduce(out)
        return out
