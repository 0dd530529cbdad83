"""The dense gated MLP: ``down(act(gate) * up)`` over a fused ``[gate; up]`` projection."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from executor.layers.linear import Linear
from executor.ops import Ops

if TYPE_CHECKING:
    from executor.parallel import TensorParallel

# transformers' names of the activations a gated MLP applies to its gate half.
SILU, GELU_TANH = ("silu", "swish"), ("gelu_pytorch_tanh", "gelu_tanh")
ACTIVATIONS = SILU + GELU_TANH


def act_and_mul(ops: Ops, act: str) -> Callable[..., torch.Tensor]:
    """The `Ops` function computing ``act(x[:, :I]) * x[:, I:]`` for transformers' ``act``."""
    if act in SILU:
        return ops.silu_and_mul
    if act in GELU_TANH:
        return ops.gelu_tanh_and_mul
    raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")


class DenseMLP:
    """SwiGLU or GeGLU (tanh) MLP. With tensor parallelism ``gate_up`` holds this rank's columns
    and ``down`` its rows: the output is a partial sum, all-reduced here."""

    __slots__ = ("gate_up", "down", "act", "tp")

    def __init__(self, gate_up: Linear, down: Linear, ops: Ops, act: str, tp: TensorParallel | None) -> None:
        self.gate_up, self.down, self.tp = gate_up, down, tp
        self.act = act_and_mul(ops, act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.down(self.act(self.gate_up(x)))
        if self.tp is not None:
            self.tp.all_reduce(h)
        return h
