"""RMSNorm with an optional fused residual add: one program per row, fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the model dtype like an unfused add would be, and normalised
        # in that rounded form so both paths see the same residual stream.
        rounded = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, rounded, mask=mask)
        x = rounded.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` -> ``(out, new_residual)``; with ``residual`` the sum ``x + residual`` is
    normalised and returned as ``new_residual``, otherwise ``new_residual`` is ``x``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    rows, hidden = x2.shape
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        assert r2.stride(-1) == 1
        new_residual = torch.empty_like(out)
    else:
        r2, new_residual = x2, out  # unused placeholders for the pointer arguments
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_residual,
            hidden,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_residual.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    if residual is None:
        return out.reshape(shape), x
    return out.reshape(shape), new_residual.reshape(shape)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference of :func:`rms_norm`."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), x
