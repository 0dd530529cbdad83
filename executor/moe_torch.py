"""The torch backend's `Ops.fused_moe`: routed experts batched per expert (the CPU path).

The ``T x k`` (token, choice) assignments are sorted by expert once; each expert that received
any runs two matmuls over all of its rows at once (gate/up, then down). The Python loop is over
experts that have tokens (at most ``E``), never over tokens. The rows return to (token, choice)
order by one gather (not a scatter-add, whose colliding rows run serially on CPU) and one batched
matmul weights and sums each token's k choices. The same structure as the Triton kernel
(`executor/kernels/fused_moe.py`: sort by expert, grouped GEMM, weighted sum over the choices),
without the block padding a GPU needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.ops import MOE_ACTIVATIONS, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT


def expert_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated activation of an expert's gate/up output ``h`` ``[N, 2I]`` (gate first) -> ``[N, I]``.

    ``silu``: ``silu(gate) * up``. ``swigluoai`` (gpt-oss): gate clamped above at the limit, up
    clamped to +-limit, then ``(up + 1) * gate * sigmoid(alpha * gate)``.
    """
    inter = h.shape[-1] // 2
    gate, up = h[:, :inter], h[:, inter:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    raise ValueError(f"unknown MoE activation {activation!r}; expected one of {MOE_ACTIVATIONS}")


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
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` (see `executor.ops.Ops`).

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``; b13 ``[E, 2I]``
    and b2 ``[E, H]`` or None; topk_weights ``[T, k]`` (fp32), topk_ids ``[T, k]`` (int64).
    Returns ``[T, H]`` in x's dtype; the weighted sum over the k choices is accumulated in fp32.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    flat_ids = topk_ids.reshape(-1)
    # Stable, so an expert's rows keep token order (deterministic, whatever the batch).
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync per call
    rows_in = x.index_select(0, order // top_k)  # [T*k, H], grouped by expert
    rows_out = torch.empty(rows_in.shape[0], hidden, dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = F.linear(rows_in[rows], w13[expert], None if b13 is None else b13[expert])
        y = F.linear(expert_activation(h, activation), w2[expert], None if b2 is None else b2[expert])
        rows_out[rows] = y
        start += n
    # Back to (token, choice) order by the inverse permutation, then the weighted sum over the k.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_choice = rows_out.index_select(0, inverse).view(num_tokens, top_k, hidden)
    out = torch.bmm(topk_weights.float().unsqueeze(1), per_choice).squeeze(1)
    return out.to(x.dtype)
