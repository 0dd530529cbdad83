"""The kernel interface the model code calls, with one implementation per backend.

The model never branches on the backend: it calls ``ops.<name>``. ``torch`` is the CPU path
(and the reference); ``triton`` runs the kernels in ``executor/kernels``. `executor.backends`
picks one; this module imports neither, so the backends can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# `Ops.fused_moe`'s activations (a kernel's index into this tuple is its ACTIVATION switch).
MOE_ACTIVATIONS = ("silu", "swigluoai")
# gpt-oss's clamped SwiGLU ("swigluoai"): its released configs' swiglu_alpha and swiglu_limit.
# A checkpoint with other values is refused by its family (`executor.models.gpt_oss`).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


@dataclass(slots=True, frozen=True)
class Ops:
    """Signatures (all tensors on the model's device):

    - ``write_kv(key, value, k_cache, v_cache, slot_mapping)``: key/value ``[T, Hkv, D]`` into
      caches ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping[t]`` (skip slot < 0). In place.
    - ``paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=None, sinks=None,
      softcap=None) -> out``: q ``[T, Hq, D]``, out ``[T, Hq, D]``; causal over each sequence's
      cached prefix plus its new tokens (GQA: query head h uses KV head ``h // (Hq // Hkv)``).
      K/V of the new tokens are already written. ``sliding_window`` W: a query at position p
      sees keys p-W+1 .. p only (W keys, itself included). ``softcap`` c: each score becomes
      ``c * tanh(score / c)`` after scaling, before masking. ``sinks``: fp32 ``[Hq]`` (this
      rank's heads), a per-head logit in each softmax's denominator with no value: with m the
      row max over the scores and the sink, ``out = sum_j exp(s_j - m) v_j / (exp(sink - m) +
      sum_j exp(s_j - m))``. Callers pass only the ones a layer uses.
    - ``rms_norm(x, weight, eps, residual=None) -> (out, new_residual)``: with a residual,
      ``x = x + residual`` first and that sum is returned as ``new_residual``; without one,
      ``new_residual`` is ``x`` itself.
    - ``rotary(q, k, positions, cos_sin_cache)``: neox-style rotation in place; q ``[T, Hq, D]``,
      k ``[T, Hkv, D]``, ``cos_sin_cache`` ``[max_pos, rot_dim]`` = cat(cos, sin) over rot_dim/2 each.
    - ``silu_and_mul(x) -> out``: x ``[T, 2I]`` -> ``silu(x[:, :I]) * x[:, I:]``.
    - ``gelu_tanh_and_mul(x) -> out``: x ``[T, 2I]`` -> ``gelu(x[:, :I], approximate="tanh") * x[:, I:]``.
    - ``fused_moe(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, activation="silu") -> out``:
      routed experts. x ``[T, H]``; w13 ``[E, 2I, H]`` (rows: gate I, then up I); w2 ``[E, H, I]``;
      b13 ``[E, 2I]``, b2 ``[E, H]`` or None; topk_weights ``[T, k]`` fp32; topk_ids ``[T, k]``
      int64. out ``[T, H]`` in x's dtype: ``out[t] = sum_j topk_weights[t, j] * (act(x[t] @
      w13[e].T + b13[e]) @ w2[e].T + b2[e])`` with ``e = topk_ids[t, j]``. ``activation``:
      ``"silu"`` = silu(gate) * up; ``"swigluoai"`` (gpt-oss) = gate.clamp(max=7),
      up.clamp(-7, 7), (up + 1) * gate * sigmoid(1.702 * gate). Routing (softmax, top-k,
      renormalisation) is the caller's (`executor.layers.moe`), never done here.
    """

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    gelu_tanh_and_mul: Callable[..., torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]
