"""Paged attention over a batch that mixes prefill chunks and decodes (one launch).

Grid ``(programs, num_kv_heads)``: each program takes ``BLOCK_Q`` query tokens of one sequence
times the query heads that share one KV head, packed into ``BLOCK_M`` rows so the KV tile is
loaded once for the whole GQA group. A decode-only batch launches one program per sequence (the
decode tile). A mixed batch launches twice, from work lists made once per step: its one-token
rows on the decode tile, its longer chunks on the prefill tile, one program per ``BLOCK_Q`` block;
either way the grid is exactly the programs with work. KV is walked in ``TILE_N`` tiles that are independent of the
cache block size (each key looks up its own block id), with an online softmax in fp32.

The variants of `executor.ops.Ops.paged_attention` are compile-time switches: a sliding window
(tiles wholly before the earliest row's window are never walked, so blocks a window-aware KV
manager freed are never read), attention sinks (the online softmax starts from the sink logit,
vLLM's unified attention) and logit soft-capping (after scaling, before masking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor.attention_metadata import AttentionMetadata
from executor.kernels.activation import tanh

LOG2E = 1.4426950408889634


@triton.jit
def init_softmax(sinks_ptr, q_head, row_valid, USE_SINKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Running max and sum of an online softmax before any key: -inf and 0, or, with sinks, the
    sink logit (base 2, as the caller passes it) and 1, so exp(sink) joins the denominator with no
    value (vLLM's unified attention)."""
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + q_head, mask=row_valid, other=float("-inf"))
        l_i = tl.where(row_valid, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def attend_tiles(
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
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax attention of the rows of ``q`` over keys ``[kv_lo, kv_hi)`` of one sequence.

    Row r sees key n iff ``n <= q_abs[r]`` (causal) and, with ``USE_WINDOW``,
    ``n > q_abs[r] - window``. Keys outside ``[kv_lo, kv_hi)`` are never loaded: with a window the
    caller passes the earliest row's window start as ``kv_lo``. ``softcap`` is the cap in base-2
    units (c * log2(e)), as the scores here are. Shared by the 2D kernel and split-KV decode.
    """
    # Tiles start on a TILE_N boundary (aligned loads); the keys before kv_lo stay masked.
    for start in range(kv_lo - kv_lo % TILE_N, kv_hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_valid = (offs_n >= kv_lo) & (offs_n < kv_hi)
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        k_off = block * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_ks
        v_off = block * stride_vb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_vs
        kv_mask_t = d_mask[:, None] & n_valid[None, :]
        # Masked loads: stale slots past seq_len may hold anything, NaN included.
        k = tl.load(k_base + k_off[None, :] + offs_d[:, None], mask=kv_mask_t, other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            s = softcap * tanh(s / softcap)
        visible = (offs_n[None, :] <= q_abs[:, None]) & n_valid[None, :] & row_valid[:, None]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_abs[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + v_off[:, None] + offs_d[None, :],
            mask=n_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,  # fp32 [Hq], base 2; read only with USE_SINKS
    work_seq_ptr,  # int32 [programs]: each program's sequence; read unless DIRECT
    work_block_ptr,  # int32 [programs]: each program's q block; read unless DECODE_TILE
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    softcap,  # soft-cap * log2(e); read only with USE_SOFTCAP
    window,  # sliding window in keys; read only with USE_WINDOW
    num_queries_per_kv,
    head_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,  # program i is sequence i (a decode-only batch): no work list
    DECODE_TILE: tl.constexpr,  # every program's sequence has one query token: q block 0
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DIRECT:
        seq_idx = pid
    else:
        seq_idx = tl.load(work_seq_ptr + pid)
    if DECODE_TILE:
        q_block = 0
    else:
        q_block = tl.load(work_block_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    local_q = offs_m // QPK_PAD
    head_in_group = offs_m % QPK_PAD
    q_pos = q_block * BLOCK_Q + local_q
    row_valid = (local_q < BLOCK_Q) & (q_pos < q_len) & (head_in_group < num_queries_per_kv)
    q_head = kv_head * num_queries_per_kv + head_in_group
    d_mask = offs_d < head_size
    token = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_abs = ctx_len + q_pos  # absolute position of each row's token (causal limit)

    m_i, l_i = init_softmax(sinks_ptr, q_head, row_valid, USE_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys this tile can see: the cached prefix plus new tokens up to its last row; with a
    # window, none before its first row's window.
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0)
    table = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    m_i, l_i, acc = attend_tiles(
        q,
        m_i,
        l_i,
        acc,
        q_abs,
        row_valid,
        offs_d,
        d_mask,
        kv_start,
        kv_end,
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

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (tf32 would miss fp32 tolerances); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_config(max_query_len: int, num_queries_per_kv: int, head_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options: heuristics, no autotune (it breaks the interpreter).

    ``max_query_len == 1`` gives the decode tile (one token, the GQA group as rows), else the
    prefill tile. Chosen from the sm_90 build with the JIT's specialisation (tests/sm90_build.py):
    none of these spill. fp32 takes the exact ("ieee") dot, whose operands and accumulators
    need twice the registers of 16-bit ones, so its prefill tiles are smaller.
    """
    qpk_pad = triton.next_power_of_2(num_queries_per_kv)
    head_pad = max(16, triton.next_power_of_2(head_size))
    fp32 = dtype == torch.float32
    if max_query_len == 1:
        # Decode: one token per program; rows are the GQA group, padded to tl.dot's 16.
        block_m = max(16, qpk_pad)
        block_q, tile_n, warps, stages = 1, (64 if head_pad <= 128 else 16), 8, 2
    elif fp32:
        block_m = max(64 if head_pad <= 128 else 32, qpk_pad)
        block_q, tile_n, warps, stages = block_m // qpk_pad, 16, 8, 2
    elif head_pad <= 128:
        block_m = max(128, qpk_pad)
        block_q, tile_n, warps, stages = block_m // qpk_pad, 32, 8, 3
    else:
        block_m = max(64, qpk_pad)
        block_q, tile_n, warps, stages = block_m // qpk_pad, 16, 8, 2
    return dict(
        QPK_PAD=qpk_pad, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, HEAD_PAD=head_pad, num_warps=warps, num_stages=stages
    )


def work_lists(meta: AttentionMetadata, block_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(decode sequences, prefill programs' sequences, their q blocks) of a mixed batch, int32 on
    ``device``: sequences of one query token run on the decode tile, longer ones get one
    program per ``block_q`` tokens (none of zero tokens). Made on the host from the step's query
    lengths with one copy, once per step: the first layer keeps them in ``meta.derived``."""
    key = f"attention_work_{block_q}"
    if key + "_decode" not in meta.derived:
        lens = torch.tensor(meta.query_lens_list, dtype=torch.int64)
        decode = torch.nonzero(lens == 1).flatten()
        prefill = torch.nonzero(lens > 1).flatten()
        blocks = (lens[prefill] + block_q - 1) // block_q
        seqs = torch.repeat_interleave(prefill, blocks)
        q_blocks = torch.arange(seqs.numel()) - torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)
        parts = (decode, seqs, q_blocks)
        # Each list starts on 16 bytes: the JIT specialises pointers on that alignment, and an
        # unaligned one would compile a second variant of the kernel.
        padded = [torch.nn.functional.pad(p, (0, -p.numel() % 4)) for p in parts]
        flat = torch.cat(padded).to(torch.int32).to(device, non_blocking=True)
        at = 0
        for name, part, pad in zip(("decode", "seqs", "blocks"), parts, padded):
            meta.derived[f"{key}_{name}"] = flat[at : at + part.numel()]
            at += pad.numel()
    return meta.derived[f"{key}_decode"], meta.derived[f"{key}_seqs"], meta.derived[f"{key}_blocks"]


@dataclass(frozen=True, slots=True)
class Variant:
    """The optional terms of `executor.ops.Ops.paged_attention`, as the kernels take them."""

    sinks: torch.Tensor | None  # fp32 [Hq] times log2(e) (base 2, as the kernels' scores), contiguous
    softcap: float  # c * log2(e) (the kernels' scores are base 2); 0.0 = off
    window: int  # keys a query sees, itself included; 0 = no window

    @staticmethod
    def of(q: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> Variant:
        """Check the arguments against q ``[T, Hq, D]`` and convert them."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {softcap}")
        if sinks is not None:
            if sinks.shape != (q.shape[1],):
                raise ValueError(f"sinks must have shape [{q.shape[1]}] (one per query head), got {list(sinks.shape)}")
            sinks = sinks.to(device=q.device, dtype=torch.float32) * LOG2E
        return Variant(sinks, softcap * LOG2E if softcap else 0.0, sliding_window or 0)

    def kernel_args(self, q: torch.Tensor) -> tuple[torch.Tensor, float, int, dict[str, bool]]:
        """(sinks pointer, softcap, window, switches): an unused pointer is q, never read."""
        flags = dict(USE_WINDOW=self.window > 0, USE_SINKS=self.sinks is not None, USE_SOFTCAP=self.softcap > 0)
        return (self.sinks if self.sinks is not None else q), self.softcap, self.window, flags

    def visible_keys(self, max_seq_len: int) -> int:
        """The most keys one query attends to: its window, or the whole sequence."""
        return min(max_seq_len, self.window) if self.window else max_seq_len


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    variant: Variant,
    cfg: dict[str, int],
    work: tuple[int, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """One launch of the 2D kernel over ``work`` = (programs, their sequences or None: program i
    is sequence i, their q blocks or None: the decode tile, block 0)."""
    programs, work_seqs, work_blocks = work
    sinks, softcap, window, flags = variant.kernel_args(q)
    _paged_attention_kernel[(programs, k_cache.shape[2])](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        sinks,
        work_seqs if work_seqs is not None else q,  # an unused pointer is q, never read
        work_blocks if work_blocks is not None else q,
        scale * LOG2E,
        softcap,
        window,
        q.shape[1] // k_cache.shape[2],
        q.shape[2],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        DOT_PRECISION=dot_precision(q.dtype),
        DIRECT=work_seqs is None,
        DECODE_TILE=work_blocks is None,
        **flags,
        **cfg,
    )


def paged_attention_2d(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    variant: Variant | None = None,
) -> torch.Tensor:
    """Causal paged attention for a mixed prefill/decode batch; q ``[T, Hq, D]`` -> ``[T, Hq, D]``;
    ``variant``: window, sinks, soft-cap (None: none of them)."""
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    qpk = num_heads // num_kv_heads
    variant = variant or Variant.of(q, None, None, None)
    decode_cfg = launch_config(1, qpk, head_size, q.dtype)
    if meta.max_query_len == 1:  # decode only: program i is sequence i (what graphs capture)
        _launch(q, k_cache, v_cache, out, meta, scale, variant, decode_cfg, (meta.num_seqs, None, None))
        return out
    prefill_cfg = launch_config(meta.max_query_len, qpk, head_size, q.dtype)
    decode, seqs, q_blocks = work_lists(meta, prefill_cfg["BLOCK_Q"], q.device)
    if decode.numel():
        _launch(q, k_cache, v_cache, out, meta, scale, variant, decode_cfg, (decode.numel(), decode, None))
    if seqs.numel():
        _launch(q, k_cache, v_cache, out, meta, scale, variant, prefill_cfg, (seqs.numel(), seqs, q_blocks))
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Plain torch reference: gather blocks, expand GQA, causal mask, softmax in fp32."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_list):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_lo:q_hi].float()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out
