"""Split-KV decode attention ("3D") plus its log-sum-exp reduction.

With few decoding sequences the 2D kernel launches only ``num_seqs * num_kv_heads`` programs, too
few to keep every SM streaming KV. Here each sequence's context is cut into ``num_splits`` ranges
handled by separate programs; each writes a normalised partial output and its log-sum-exp (base 2),
and a second kernel merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.attention_metadata import AttentionMetadata
from executor.kernels.paged_attention import (
    LOG2E,
    Variant,
    attend_tiles,
    dot_precision,
    init_softmax,
    launch_config,
)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,  # fp32 [T, Hq, num_splits, D]
    part_lse_ptr,  # fp32 [T, Hq, num_splits]
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    qk_scale,
    softcap,
    window,
    num_splits,
    num_queries_per_kv,
    head_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq_idx).to(tl.int64)  # one query token per sequence
    seq_len = tl.load(seq_lens_ptr + seq_idx)

    # The keys the query sees: all, or its window. They are split on whole tiles so every
    # program but the first and last walks full tiles.
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    first_tile = first // TILE_N
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N) - first_tile, num_splits)
    tile_lo = (first_tile + split * tiles_per_split) * TILE_N
    kv_lo = tl.maximum(tile_lo, first)
    kv_hi = tl.minimum(tile_lo + tiles_per_split * TILE_N, seq_len)

    offs_m = tl.arange(0, BLOCK_M)  # rows = the query heads of this KV head (padded)
    offs_d = tl.arange(0, HEAD_PAD)
    row_valid = offs_m < num_queries_per_kv
    d_mask = offs_d < head_size
    q_head = kv_head * num_queries_per_kv + offs_m
    q = tl.load(
        q_ptr + token * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )

    # The sink joins the softmax once: in the first split's partial (its lse carries it).
    first_split = (offs_m * 0 + split) == 0  # a block, not a scalar: the interpreter masks with blocks only
    m_i, l_i = init_softmax(sinks_ptr, q_head, row_valid & first_split, USE_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # The single query sits at position seq_len - 1: every key of the split is visible.
    q_abs = tl.full([BLOCK_M], 0, dtype=tl.int32) + (seq_len - 1)
    m_i, l_i, acc = attend_tiles(
        q,
        m_i,
        l_i,
        acc,
        q_abs,
        row_valid,
        offs_d,
        d_mask,
        kv_lo,
        kv_hi,
        qk_scale,
        softcap,
        window,
        table,
        k_base,
        v_base,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        BLOCK_SIZE,
        TILE_N,
        USE_WINDOW,
        USE_SOFTCAP,
        DOT_PRECISION,
    )

    # An empty split (short sequence) leaves l = 0: lse = -inf gives it zero weight.
    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    lse = tl.where(has_mass, m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
    part = token * stride_pt + q_head.to(tl.int64) * stride_ph + split * stride_ps
    tl.store(
        part_out_ptr + part[:, None] + offs_d[None, :],
        out,
        mask=row_valid[:, None] & d_mask[None, :],
    )
    tl.store(part_lse_ptr + part // HEAD_PAD, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_splits,
    head_size,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    token = tl.load(query_start_loc_ptr + seq_idx).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < num_splits
    base = token * stride_pt + head * stride_ph
    lse = tl.load(part_lse_ptr + (base + offs_s * stride_ps) // HEAD_PAD, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # 0 for empty splits
    total = tl.sum(w, 0)
    part = tl.load(
        part_out_ptr + base + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < head_size),
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < head_size,
    )


def split_config(num_queries_per_kv: int, head_size: int, dtype: torch.dtype) -> dict[str, int]:
    """The 2D kernel's decode tiles (same loop, same register limits; see launch_config)."""
    cfg = launch_config(1, num_queries_per_kv, head_size, dtype)
    return {k: cfg[k] for k in ("BLOCK_M", "TILE_N", "HEAD_PAD", "num_warps", "num_stages")}


def decode_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    variant: Variant | None = None,
) -> torch.Tensor:
    """Split-KV attention for a decode-only batch (every query_len == 1); with a window, the
    splits cut the window's keys only."""
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    assert meta.max_query_len <= 1, "split-KV decode handles one query token per sequence"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    num_seqs = meta.num_seqs
    if num_seqs == 0:
        return out
    qpk = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    # Partials padded to HEAD_PAD so the lse index is the partial's row offset / HEAD_PAD.
    part_out = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    sinks, softcap, window, flags = (variant or Variant.of(q, None, None, None)).kernel_args(q)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        sinks,
        scale * LOG2E,
        softcap,
        window,
        num_splits,
        qpk,
        head_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        DOT_PRECISION=dot_precision(q.dtype),
        **flags,
        **split_config(qpk, head_size, q.dtype),
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        meta.query_start_loc,
        num_splits,
        head_size,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        out.stride(0),
        out.stride(1),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_PAD=head_pad,
        num_warps=4,
    )
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many KV splits a decode-only batch gets; 1 means the 2D kernel is used.

    Aim for about four programs per SM, and give each split at least 512 keys so the
    merge and the partial writes stay small next to the KV read.
    """
    programs = num_seqs * num_kv_heads
    if max_seq_len < 1024 or programs >= 4 * num_sms:
        return 1
    want = triton.cdiv(4 * num_sms, programs)
    most = max(1, max_seq_len // 512)
    splits = min(want, most, 64)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1  # powers of two: fewer shapes


def decode_split_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Torch reference: the same function as the 2D kernel (splits do not change the result)."""
    from executor.kernels.paged_attention import paged_attention_ref

    del num_splits
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
