"""Triton kernels behind ``get_ops("triton")``.

On a machine without CUDA the kernels run under Triton's interpreter (slow, for tests). The
interpreter must be chosen before any kernel is defined, so it is switched on here, before the
kernel modules are imported, unless the caller already decided via ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from executor.attention_metadata import AttentionMetadata  # noqa: E402
from executor.kernels.activation import gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from executor.kernels.decode_split import choose_num_splits, decode_split  # noqa: E402
from executor.kernels.fused_moe import fused_moe  # noqa: E402
from executor.kernels.kv_write import write_kv  # noqa: E402
from executor.kernels.paged_attention import Variant, paged_attention_2d  # noqa: E402
from executor.kernels.rms_norm import rms_norm  # noqa: E402
from executor.kernels.rotary import rotary  # noqa: E402
from executor.ops import Ops  # noqa: E402

DEFAULT_NUM_SMS = 132  # H100/H200; only used when no CUDA device can be asked


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def dispatch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`executor.ops.Ops.paged_attention`: split-KV decode when few sequences decode over many
    visible keys (a window bounds them), else 2D."""
    variant = Variant.of(q, sliding_window, sinks, softcap)
    if meta.max_query_len == 1:
        keys = variant.visible_keys(meta.max_seq_len)
        splits = choose_num_splits(meta.num_seqs, k_cache.shape[2], keys, _num_sms(q.device))
        if splits > 1:
            return decode_split(q, k_cache, v_cache, meta, scale, splits, variant=variant)
    return paged_attention_2d(q, k_cache, v_cache, meta, scale, variant=variant)


OPS = Ops(
    name="triton",
    write_kv=write_kv,
    paged_attention=dispatch_attention,
    rms_norm=rms_norm,
    rotary=rotary,
    silu_and_mul=silu_and_mul,
    gelu_tanh_and_mul=gelu_tanh_and_mul,
    fused_moe=fused_moe,
)

__all__ = ["OPS", "dispatch_attention"]
