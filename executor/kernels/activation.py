"""SiLU-and-mul: ``silu(x[:, :I]) * x[:, I:]`` in fp32, tiled over the row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` -> ``[T, I]``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    assert x2.stride(-1) == 1 and shape[-1] % 2 == 0
    rows, inter = x2.shape[0], shape[-1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.reshape(*shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`silu_and_mul` (fp32 math)."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
