"""The mixture-of-experts layer: a router, the routed experts (`Ops.fused_moe`), an optional shared expert.

Routing follows each family as transformers computes it (`Router`):

- ``softmax`` (Qwen2-MoE, Qwen3-MoE, Mixtral): softmax in fp32 over all experts, then top-k; with
  ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``, Mixtral always) the k weights are divided by
  their sum. Qwen rounds the weights to the model dtype before the experts use them; Mixtral
  keeps them in fp32 (``round_to_model_dtype``).
- ``topk_softmax`` (gpt-oss): top-k on the raw router logits (the router has a bias), then a
  softmax over the k chosen, in the model dtype.

Tensor parallel is per-expert: every rank holds every expert, with ``1/world`` of each expert's
intermediate dim (gate/up rows, down columns), the router replicated. A rank's output is then a
partial sum, all-reduced once (routed and shared experts together), exactly as the dense MLP's;
the down-projection biases are held by rank 0 only. Why not expert parallel:
docs/parallelism.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executor.ops import MOE_ACTIVATIONS, Ops

if TYPE_CHECKING:
    from executor.parallel import TensorParallel

SCORINGS = ("softmax", "topk_softmax")


@dataclass(slots=True, frozen=True)
class Router:
    """How a family turns router logits ``[T, E]`` into top-k weights and expert ids."""

    top_k: int
    scoring: str = "softmax"  # one of SCORINGS
    renormalize: bool = False  # softmax scoring only: divide the k weights by their sum
    round_to_model_dtype: bool = False  # softmax scoring only: weights rounded to the logits' dtype

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown router scoring {self.scoring!r}; expected one of {SCORINGS}")

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] fp32, topk_ids [T, k] int64)`` of ``logits`` ``[T, E]``."""
        if self.scoring == "topk_softmax":
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).float(), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_to_model_dtype:
            weights = weights.to(logits.dtype).float()
        return weights, ids


@dataclass(slots=True)
class SharedExpert:
    """Qwen2-MoE's always-on expert: ``sigmoid(x @ gate.T) * mlp(x)`` (``gate`` ``[1, H]``)."""

    mlp: Callable[[torch.Tensor], torch.Tensor]
    gate: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate)) * self.mlp(x)


class MoE:
    """One sparse MLP block: route, run the chosen experts, add the shared expert if any.

    ``w13`` ``[E, 2I, H]`` (gate rows, then up rows), ``w2`` ``[E, H, I]``, biases ``b13``
    ``[E, 2I]`` / ``b2`` ``[E, H]`` or None: the layout `Ops.fused_moe` takes (under tensor
    parallel, this rank's slice of ``I``). ``router_weight`` ``[E, H]`` (and ``router_bias``
    ``[E]``) are whole on every rank. With ``tp`` the partial sums of the ranks are all-reduced
    here (the shared expert's ``mlp`` must not reduce its own).
    """

    __slots__ = ("ops", "router", "router_weight", "router_bias", "w13", "w2", "b13", "b2", "activation", "shared", "tp")

    def __init__(
        self,
        ops: Ops,
        router: Router,
        router_weight: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        router_bias: torch.Tensor | None = None,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: str = "silu",
        shared: SharedExpert | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {activation!r}; expected one of {MOE_ACTIVATIONS}")
        num_experts = w13.shape[0]
        if router_weight.shape[0] != num_experts or w2.shape[0] != num_experts:
            raise ValueError(
                f"router ({router_weight.shape[0]}), w13 ({num_experts}) and w2 ({w2.shape[0]}) disagree on the expert count"
            )
        if w13.shape[1] != 2 * w2.shape[2]:
            raise ValueError(f"w13 has {w13.shape[1]} rows; expected 2 x w2's intermediate size {w2.shape[2]}")
        if not 0 < router.top_k <= num_experts:
            raise ValueError(f"top_k={router.top_k} must be in 1..{num_experts} (the expert count)")
        self.ops = ops
        self.router = router
        self.router_weight = router_weight
        self.router_bias = router_bias
        self.w13, self.w2, self.b13, self.b2 = w13, w2, b13, b2
        self.activation = activation
        self.shared = shared
        self.tp = tp

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        logits = F.linear(x, self.router_weight, self.router_bias)
        weights, ids = self.router.route(logits)
        out = self.ops.fused_moe(x, self.w13, self.w2, weights, ids, b13=self.b13, b2=self.b2, activation=self.activation)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out


def shard_intermediate(w13: torch.Tensor, w2: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert tensor parallel: the slice ``[start, end)`` of every expert's intermediate dim.

    ``w13`` ``[E, 2I, H]`` keeps gate rows ``start:end`` and up rows ``I+start:I+end``; ``w2``
    ``[E, H, I]`` keeps columns ``start:end``. (``b13`` slices as ``w13``'s rows; ``b2`` is whole
    on rank 0, zero elsewhere.)
    """
    inter = w2.shape[2]
    w13_local = torch.cat([w13[:, start:end], w13[:, inter + start : inter + end]], dim=1)
    return w13_local, w2[:, :, start:end]


def shard_b13(b13: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``b13`` ``[E, 2I]`` cut as `shard_intermediate` cuts ``w13``'s rows."""
    inter = b13.shape[1] // 2
    return torch.cat([b13[:, start:end], b13[:, inter + start : inter + end]], dim=1)
