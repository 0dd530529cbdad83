"""RMSNorm as the model families define it: Llama's ``x̂ · w`` and Gemma's ``x̂ · (1 + w)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.ops import Ops


class RMSNorm:
    """RMSNorm over the last dimension, optionally of ``x + residual`` (see `Ops.rms_norm`).

    ``gemma``: the weight is an offset from one, and the scaling happens in fp32 before the cast
    back (transformers' Gemma computes ``(x̂ · (1 + w)).to(dtype)``, Llama ``x̂.to(dtype) · w``), so
    in low precision it runs here in torch; in fp32 both are the same op.
    """

    __slots__ = ("weight", "eps", "ops", "fp32_scale")

    def __init__(self, weight: torch.Tensor, eps: float, ops: Ops, gemma: bool = False) -> None:
        self.eps = eps
        self.ops = ops
        self.fp32_scale = gemma and weight.dtype != torch.float32
        if gemma:
            weight = 1.0 + weight.float()
            if not self.fp32_scale:
                weight = weight.to(torch.float32)
        self.weight = weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, new_residual)``: with a residual, ``x + residual`` is normed and returned."""
        if not self.fp32_scale:
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)
        return out.to(x.dtype), x

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Norm of each head of ``x`` ``[T, H, D]`` over D (q/k norm)."""
        t, h, d = x.shape
        return self(x.reshape(t * h, d))[0].view(t, h, d)
