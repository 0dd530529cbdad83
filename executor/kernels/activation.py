"""Gated activations, ``act(x[:, :I]) * x[:, I:]`` in fp32, tiled over the row: SiLU-and-mul
(Llama's MLP) and GELU(tanh)-and-mul (Gemma's); and a tanh that the attention soft-cap shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from one exp of a non-positive argument: no overflow for any x."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) * (...)
    out = 0.5 * gate * (1.0 + tanh(inner)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(kernel: triton.JITFunction, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    assert x2.stride(-1) == 1 and shape[-1] % 2 == 0
    rows, inter = x2.shape[0], shape[-1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        kernel[(rows, triton.cdiv(inter, block))](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.reshape(*shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` -> ``silu(x[:, :I]) * x[:, I:]``."""
    return _gated(_silu_and_mul_kernel, x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` -> ``gelu(x[:, :I], approximate="tanh") * x[:, I:]`` (`Ops.gelu_tanh_and_mul`)."""
    return _gated(_gelu_tanh_and_mul_kernel, x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`silu_and_mul` (fp32 math)."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`gelu_tanh_and_mul` (fp32 math)."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.gelu(xf[..., :inter], approximate="tanh") * xf[..., inter:]).to(x.dtype)
