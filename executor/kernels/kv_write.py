"""KV-cache write by slot mapping: each program copies a few new tokens' K/V into their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    num_kv_heads,
    head_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    # Rows = BLOCK_T tokens; columns = (head, dim) flattened, so one 2D tile moves them all.
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_valid = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=t_valid, other=-1).to(tl.int64)
    t_valid = t_valid & (slot >= 0)  # slot < 0: padding token, nothing to cache
    # 64-bit block math: block * stride passes 2^31 elements on large pools.
    block = tl.where(t_valid, slot, 0) // BLOCK_SIZE
    offset = tl.where(t_valid, slot, 0) % BLOCK_SIZE
    offs_c = tl.arange(0, HEADS_PAD * HEAD_PAD)
    head = offs_c // HEAD_PAD
    dim = offs_c % HEAD_PAD
    mask = t_valid[:, None] & ((head < num_kv_heads) & (dim < head_size))[None, :]

    src_k = key_ptr + offs_t[:, None] * stride_kt + (head * stride_kh + dim)[None, :]
    src_v = value_ptr + offs_t[:, None] * stride_vt + (head * stride_vh + dim)[None, :]
    dst_k = k_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None] + (head * stride_kch + dim)[None, :]
    dst_v = v_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None] + (head * stride_vch + dim)[None, :]
    tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping`` (in place).

    Slots < 0 are skipped. Caches are ``[num_blocks, block_size, Hkv, D]``; the last dim of every
    tensor must be contiguous (other strides are free, so key/value may be views of a qkv buffer).
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "last dim must be contiguous"
    assert k_cache.dtype == key.dtype and v_cache.dtype == value.dtype
    block_size = k_cache.shape[1]
    heads_pad = triton.next_power_of_2(num_kv_heads)
    head_pad = triton.next_power_of_2(head_size)
    # About 4K elements per program: one token per program for big models, several for small.
    block_t = max(1, min(64, 4096 // (heads_pad * head_pad)))
    _kv_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        num_kv_heads,
        head_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
        HEADS_PAD=heads_pad,
        HEAD_PAD=head_pad,
        num_warps=4,
    )


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain torch reference of :func:`write_kv`."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]
