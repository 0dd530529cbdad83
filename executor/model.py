"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) written against `executor.ops`.

Plain tensors and ``torch.nn.functional`` calls, no ``nn.Module``: the forward pass is a short
loop over layers whose kernels come from the selected backend. Batches are flat (``[T, ...]``,
all sequences' new tokens concatenated); the paged KV cache holds everything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executor.attention_metadata import AttentionMetadata
from executor.model_config import HFModelConfig
from executor.ops import Ops

if TYPE_CHECKING:
    from executor.parallel import TensorParallel


def rope_inv_freq(cfg: HFModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (fp32), with Llama 3 frequency-dependent scaling if configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    factor = float(sc["factor"])
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def rope_cache(cfg: HFModelConfig, max_pos: int, device: torch.device) -> torch.Tensor:
    """``[max_pos, head_dim]`` fp32 table: cat(cos, sin) of position x inverse frequency."""
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _onednn_ok(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


# oneDNN builds (JIT-compiles) and caches one primitive per (weight shape, row count), ~0.55 MB
# each, held by its primitive cache and by ideep's LRU (1024 entries each by default). Continuous
# batching brings every row count from 1 to max_num_batched_tokens, so RSS grew with each new one
# (+0.5 GB in ~3,700 requests; past the caps primitives are rebuilt and evicted without end). Row
# counts are padded up to a bucket instead: exact up to 16, then _BUCKETS_PER_OCTAVE sizes per
# power of two (padding < 1/8 of the rows; +3% linear time over 1-512 rows measured on the dev
# machine, 2304 x 768 weight). Up to 2048 rows that is 72 row counts per weight shape, so the
# caches stop growing at a few hundred primitives.
_BUCKETS_PER_OCTAVE = 8


def row_bucket(rows: int) -> int:
    """The row count a packed `Linear` runs ``rows`` rows as (``>= rows``, from a small fixed set)."""
    if rows <= 2 * _BUCKETS_PER_OCTAVE:
        return rows
    step = (1 << (rows.bit_length() - 1)) // _BUCKETS_PER_OCTAVE
    return -(-rows // step) * step


class Linear:
    """``y = x W^T + b``; on CPU (fp32) through oneDNN with the weight packed once at load time.

    ``F.linear`` on CPU hands MKL the weight in its checkpoint layout and it is re-blocked on
    every call, which dominates at decode batch sizes. Measured on the dev machine, same run:
    [64 x 768] @ [8192 x 768]^T 10.9 ms with ``F.linear``, 7.2 ms prepacked; at 7 rows 5.8 vs 1.4
    ms; within +-10% either way at 1024 rows. Results agree to ~1e-6 relative.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if _onednn_ok(weight):
            # The batch size is only a blocking hint; any number of rows is accepted later.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            self.weight = None  # the packed copy replaces it (a tied embedding keeps its own)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            padded = row_bucket(rows)
            if padded != rows:  # zero rows up to the bucket (see `row_bucket`); sliced off below
                x = F.pad(x, (0, 0, 0, padded - rows))
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y if padded == rows else y[:rows]
        assert self.weight is not None  # only dropped once `packed` replaces it
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class _Layer:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LlamaModel:
    """Decoder-only transformer over fused weights from `executor.loader.load_weights`.

    With ``tp`` (tensor parallelism), ``cfg`` is the rank's local view (its heads and MLP columns,
    `executor.parallel.ShardLayout.local_config`) and ``weights`` its shard
    (`executor.shard_loader.load_shard`): the embedding and the two row-parallel projections end in
    an all-reduce, the LM head in an all-gather.
    """

    def __init__(
        self, cfg: HFModelConfig, weights: dict[str, torch.Tensor], ops: Ops, max_pos: int, tp: TensorParallel | None = None
    ) -> None:
        self.cfg = cfg
        self.ops = ops
        self.tp = tp
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            used.add(name)
            return weights[name]

        def opt(name: str) -> torch.Tensor | None:
            return take(name) if name in weights else None

        self.embed = take("embed")
        self.norm = take("norm")
        self.lm_head = Linear(take("lm_head"))
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            e = f"layers.{i}."
            self.layers.append(
                _Layer(
                    qkv=Linear(take(e + "qkv"), opt(e + "qkv_bias")),
                    o=Linear(take(e + "o"), opt(e + "o_bias")),
                    gate_up=Linear(take(e + "gate_up"), opt(e + "gate_up_bias")),
                    down=Linear(take(e + "down"), opt(e + "down_bias")),
                    in_norm=take(e + "in_norm"),
                    post_norm=take(e + "post_norm"),
                    q_norm=opt(e + "q_norm"),
                    k_norm=opt(e + "k_norm"),
                )
            )
        if unused := sorted(set(weights) - used):
            # `executor.loader.check_checkpoint` refuses these first; this guards other callers.
            raise ValueError(f"weights the model does not use: {unused}")
        self.cos_sin_cache = rope_cache(cfg, max_pos, self.device)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (before the final norm) of the batch's new tokens."""
        cfg, ops = self.cfg, self.ops
        t = input_ids.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        eps = cfg.rms_norm_eps
        tp = self.tp
        h = F.embedding(input_ids, self.embed) if tp is None else tp.embed(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = ops.rms_norm(h, layer.in_norm, eps, residual)
            qkv = layer.qkv(x)
            q = qkv[:, :q_end].view(t, hq, d)
            k = qkv[:, q_end:k_end].view(t, hkv, d)
            v = qkv[:, k_end:].view(t, hkv, d)
            if layer.q_norm is not None:
                q = ops.rms_norm(q.reshape(t * hq, d), layer.q_norm, eps)[0].view(t, hq, d)
                k = ops.rms_norm(k.reshape(t * hkv, d), layer.k_norm, eps)[0].view(t, hkv, d)
            ops.rotary(q, k, positions, self.cos_sin_cache)
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
            h = layer.o(attn.reshape(t, hq * d))
            if tp is not None:  # row-parallel: each rank holds a partial sum
                tp.all_reduce(h)
            x, residual = ops.rms_norm(h, layer.post_norm, eps, residual)
            h = layer.down(ops.silu_and_mul(layer.gate_up(x)))
            if tp is not None:
                tp.all_reduce(h)
        assert residual is not None
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the given hidden rows (only those that are sampled)."""
        x, _ = self.ops.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        logits = self.lm_head(x)
        if self.tp is not None:  # vocabulary-parallel head: each rank has a block of columns
            logits = self.tp.gather_logits(logits, self.cfg.vocab_size)
        return logits.float()
