"""`CausalLM`: the decoder every family composes from the shared layers (`executor.layers`).

Plain tensors and ops calls, no ``nn.Module``: the forward pass is a short loop over layers whose
kernels come from the selected backend. Batches are flat (``[T, ...]``, all sequences' new tokens
concatenated); the paged KV cache holds everything else. The residual stream is carried apart
from each block's output and added inside the next norm (`Ops.rms_norm`'s residual).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executor.attention_metadata import AttentionMetadata
from executor.layers.attention import Attention
from executor.layers.linear import Linear
from executor.layers.norm import RMSNorm
from executor.layers.rotary import RopeTables
from executor.layers.weights import Weights
from executor.model_config import HFModelConfig
from executor.ops import Ops

if TYPE_CHECKING:
    from executor.models.base import ModelFamily
    from executor.parallel import TensorParallel


@dataclass(slots=True)
class DecoderLayer:
    """Attention then MLP, each after a norm; sandwich norms (Gemma) also norm each output."""

    attn: Attention
    mlp: Callable[[torch.Tensor], torch.Tensor]
    in_norm: RMSNorm
    post_norm: RMSNorm  # before the MLP
    attn_out_norm: RMSNorm | None
    mlp_out_norm: RMSNorm | None

    def __call__(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block output, residual stream)``: the next layer adds them in its first norm."""
        x, residual = self.in_norm(h, residual)
        h = self.attn(x, positions, kv[0], kv[1], meta)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)[0]
        x, residual = self.post_norm(h, residual)
        h = self.mlp(x)
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)[0]
        return h, residual


class CausalLM:
    """Decoder-only transformer over fused weights (`executor.models.base.ModelFamily.fuse`).

    With ``tp`` (tensor parallelism), ``cfg`` is the rank's local view (its heads and MLP columns,
    `executor.parallel.ShardLayout.local_config`) and ``weights`` its shard
    (`executor.shard_loader.load_shard`): the embedding and the two row-parallel projections end in
    an all-reduce, the LM head in an all-gather.
    """

    def __init__(
        self,
        family: ModelFamily,
        cfg: HFModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        max_pos: int,
        tp: TensorParallel | None = None,
    ) -> None:
        self.cfg, self.ops, self.tp = cfg, ops, tp
        w = Weights(weights)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w.take(name), cfg.rms_norm_eps, ops, cfg.gemma_norm)

        self.embed = w.take("embed")
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.norm = norm("norm")
        self.lm_head = Linear(w.take("lm_head"))
        # transformers multiplies by the scale cast to the weights' dtype first (Gemma).
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale, dtype=self.dtype).item()
        ropes = RopeTables(cfg, max_pos, self.device)
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_layers):
            e = f"layers.{i}."
            attn = Attention(cfg, i, w, ops, ropes.table(cfg.rope(i)), tp, e)
            self.layers.append(
                DecoderLayer(
                    attn=attn,
                    mlp=family.make_mlp(cfg, i, w, ops, tp),
                    in_norm=norm(e + "in_norm"),
                    post_norm=norm(e + "post_norm"),
                    attn_out_norm=norm(e + "attn_out_norm") if cfg.sandwich_norm else None,
                    mlp_out_norm=norm(e + "mlp_out_norm") if cfg.sandwich_norm else None,
                )
            )
        w.check_all_used()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm) of the batch's new tokens."""
        tp = self.tp
        h = F.embedding(input_ids, self.embed) if tp is None else tp.embed(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        residual: torch.Tensor | None = None
        per_layer = meta.per_layer
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, positions, kv, meta if per_layer is None else per_layer[i])
        assert residual is not None
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the given hidden rows (only those that are sampled)."""
        x, _ = self.norm(hidden)
        logits = self.lm_head(x)
        if self.tp is not None:  # vocabulary-parallel head: each rank has a block of columns
            logits = self.tp.gather_logits(logits, self.cfg.vocab_size)
        if (cap := self.cfg.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
