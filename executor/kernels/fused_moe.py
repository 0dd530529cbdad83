"""Fused mixture-of-experts: `executor.ops.Ops.fused_moe` as two grouped-GEMM launches.

As vLLM's and SGLang's ``fused_moe``: `moe_align_block_size` sorts the ``T * k`` (token, expert)
assignments by expert and pads each expert's run to a multiple of ``BLOCK_M``, so every row block
of the sorted list belongs to one expert. One launch then computes, for each block, its expert's
gate and up projections of the block's tokens and the activation (the ``[T * k, I]`` intermediate);
a second launch its down projection with the bias and the top-k weight in the epilogue. The k
weighted rows of a token are summed last.

Sizes that vary per step are runtime arguments and the sorted list is sized by an upper bound
computed on the host from shapes alone, so nothing syncs with the device (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor.kernels.paged_attention import dot_precision
from executor.ops import MOE_ACTIVATIONS, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the flattened assignments ``topk_ids`` ``[T, k]`` by expert, each expert padded to
    ``block_m`` rows.

    Returns ``sorted_ids`` (int32 ``[num_blocks * block_m]``: indices into the flattened
    ``[T * k]`` assignments, expert by expert in token order, padding = ``T * k``) and
    ``expert_ids`` (int32 ``[num_blocks]``: each block's expert, -1 for blocks past the end).
    ``num_blocks`` is an upper bound from the shapes (no device sync): at most ``T * k`` blocks
    hold a row, and the padding adds at most one block per expert.
    """
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    num_blocks = min(n, triton.cdiv(n + num_experts * (block_m - 1), block_m))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: that syncs for its size
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    # Block b belongs to the expert whose [start, end) block range holds it; empty experts have
    # start == end and are skipped by right=True.
    expert_ids = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    dest = (block_end - blocks)[experts] * block_m + rank
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    return sorted_ids, expert_ids


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: row id // a_row_div of each sorted id
    b_ptr,  # [E, N (x2 when GATED), K]
    bias_ptr,  # [E, N (x2 when GATED)]; read only with HAS_BIAS
    c_ptr,  # [T * k, N]: row = sorted id
    topk_weights_ptr,  # fp32 [T * k]; read only with MUL_WEIGHT
    sorted_ids_ptr,
    expert_ids_ptr,
    N,
    K,
    num_valid,  # T * k: sorted ids >= this are padding
    a_row_div,
    stride_am,
    stride_be,
    stride_bn,
    stride_biase,
    stride_cm,
    alpha,
    limit,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``C[id] = epilogue(A[id // a_row_div] @ B[expert].T)`` for the BLOCK_M sorted ids of one
    block and BLOCK_N output columns. GATED: B holds gate rows ``0..N`` and up rows ``N..2N``; the
    program computes both and stores ``act(gate, up)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the last expert's padded run
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < num_valid
    a_rows = (ids // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am
    b_base = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_base + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b = tl.load(b_base + (k0 + offs_k)[:, None], mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_base + N * stride_bn + (k0 + offs_k)[:, None], mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias_base = bias_ptr + expert * stride_biase
        acc += tl.load(bias_base + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_base + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 0:  # silu(gate) * up
            acc = acc * tl.sigmoid(acc) * acc_up
        else:  # gpt-oss: clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + ids, mask=row_ok, other=0.0)[:, None]
    tl.store(
        c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


def moe_config(num_assignments: int, num_experts: int) -> dict[str, int]:
    """Tile sizes (heuristics, no autotune): as vLLM's defaults, small row blocks while most
    experts get a few tokens (decode), larger once they get many. The gated GEMM holds two
    accumulators; these sizes compile for sm_90 without spills (tests/kernel_cases.py)."""
    if num_assignments <= 2 * num_experts:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    a_row_div: int,
    gated: bool,
    activation: int,
    cfg: dict[str, int],
) -> None:
    """One grouped GEMM over every block of ``sorted_ids``: ``c[id] = epilogue(a[id // a_row_div]
    @ b[expert].T)`` with ``c``'s width as N."""
    n_out = c.shape[1]
    grid = (expert_ids.numel(), triton.cdiv(n_out, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a,
        b,
        bias if bias is not None else b,
        c,
        topk_weights if topk_weights is not None else c,
        sorted_ids,
        expert_ids,
        n_out,
        a.shape[1],
        c.shape[0],
        a_row_div,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        bias.stride(0) if bias is not None else 0,
        c.stride(0),
        SWIGLUOAI_ALPHA,
        SWIGLUOAI_LIMIT,
        GATED=gated,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=topk_weights is not None,
        DOT_PRECISION=dot_precision(a.dtype),
        **cfg,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """`executor.ops.Ops.fused_moe`: x ``[T, H]``, w13 ``[E, 2I, H]`` (gate rows, then up), w2
    ``[E, H, I]``, biases ``[E, 2I]``/``[E, H]``, topk ``[T, k]`` -> ``[T, H]`` in x's dtype."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {MOE_ACTIVATIONS}")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    b13 = b13.contiguous() if b13 is not None else None
    b2 = b2.contiguous() if b2 is not None else None
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    n = num_tokens * top_k
    cfg = moe_config(n, num_experts)
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, cfg["BLOCK_M"], num_experts)
    # Row t * k + j of both buffers is token t's j-th expert.
    hidden_act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    _launch(x, w13, b13, hidden_act, None, sorted_ids, expert_ids, top_k, True, MOE_ACTIVATIONS.index(activation), cfg)
    # fp32 rows, so the k-sum rounds once, to x's dtype.
    weighted = torch.empty((n, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _launch(hidden_act, w2, b2, weighted, weights, sorted_ids, expert_ids, 1, False, 0, cfg)
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
