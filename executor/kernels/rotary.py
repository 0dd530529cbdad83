"""Neox-style rotary embedding applied in place to q and k: one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, token, num_heads, half, cos, sin, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_r = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_r[None, :] < half)
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    num_q_heads,
    num_k_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    QHEADS_PAD: tl.constexpr,
    KHEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    r_mask = offs_r < half
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr, stride_qt, stride_qh, token, num_q_heads, half, cos, sin, QHEADS_PAD, HALF_PAD)
    _rotate(k_ptr, stride_kt, stride_kh, token, num_k_heads, half, cos, sin, KHEADS_PAD, HALF_PAD)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate the first ``rot_dim`` dims of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place.

    ``cos_sin_cache`` is ``[max_pos, rot_dim]`` = cat(cos, sin); neox style pairs dim ``i`` with
    ``i + rot_dim/2``.
    """
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    half = cos_sin_cache.shape[1] // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.shape[1],
        k.shape[1],
        half,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        QHEADS_PAD=triton.next_power_of_2(q.shape[1]),
        KHEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Plain torch reference of :func:`rotary` (in place, fp32 math)."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)
