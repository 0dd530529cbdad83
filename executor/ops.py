"""The kernel interface the model code calls, with one implementation per backend.

The model never branches on the backend: it calls ``ops.<name>``. ``torch`` is the CPU path
(and the reference); ``triton`` runs the kernels in ``executor/kernels``. `executor.backends`
picks one; this module imports neither, so the backends can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class Ops:
    """Signatures (all tensors on the model's device):

    - ``write_kv(key, value, k_cache, v_cache, slot_mapping)``: key/value ``[T, Hkv, D]`` into
      caches ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping[t]`` (skip slot < 0). In place.
    - ``paged_attention(q, k_cache, v_cache, meta, scale) -> out``: q ``[T, Hq, D]``, out
      ``[T, Hq, D]``; causal over each sequence's cached prefix plus its new tokens (GQA:
      query head h uses KV head ``h // (Hq // Hkv)``). K/V of the new tokens are already written.
    - ``rms_norm(x, weight, eps, residual=None) -> (out, new_residual)``: with a residual,
      ``x = x + residual`` first and that sum is returned as ``new_residual``; without one,
      ``new_residual`` is ``x`` itself.
    - ``rotary(q, k, positions, cos_sin_cache)``: neox-style rotation in place; q ``[T, Hq, D]``,
      k ``[T, Hkv, D]``, ``cos_sin_cache`` ``[max_pos, rot_dim]`` = cat(cos, sin) over rot_dim/2 each.
    - ``silu_and_mul(x) -> out``: x ``[T, 2I]`` -> ``silu(x[:, :I]) * x[:, I:]``.
    - ``fused_moe(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, activation="silu") -> out``:
      x ``[T, H]``, w13 ``[E, 2I, H]`` (gate rows, then up), w2 ``[E, H, I]``, b13 ``[E, 2I]``,
      b2 ``[E, H]``, topk_weights fp32 / topk_ids int64 ``[T, k]``; out ``[T, H]`` in x's dtype:
      ``sum_j topk_weights[t, j] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])`` with
      ``e = topk_ids[t, j]``; ``act`` is ``"silu"`` (silu(gate) * up) or ``"swigluoai"``
      (gate.clamp(max=7), up.clamp(-7, 7), (up + 1) * gate * sigmoid(1.702 * gate)).
    """

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]
