"""`Linear`: ``y = x W^T + b``, with the weight packed once for oneDNN on CPU (fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_ok(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


# oneDNN builds (JIT-compiles) and caches one primitive per (weight shape, row count), each about
# half a megabyte, held by its primitive cache and by ideep's LRU (1024 entries each by default).
# Continuous batching brings every row count from 1 to max_num_batched_tokens, so without a bound
# RSS grows with each new one (and past the caps primitives are rebuilt and evicted without end).
# Row counts are padded up to a bucket instead: exact up to 16, then _BUCKETS_PER_OCTAVE sizes per
# power of two (padding < 1/8 of the rows). Up to 2048 rows that is 72 row counts per weight
# shape, so the caches stop growing at a few hundred primitives (docs/reliability.md).
_BUCKETS_PER_OCTAVE = 8


def row_bucket(rows: int) -> int:
    """The row count a packed `Linear` runs ``rows`` rows as (``>= rows``, from a small fixed set)."""
    if rows <= 2 * _BUCKETS_PER_OCTAVE:
        return rows
    step = (1 << (rows.bit_length() - 1)) // _BUCKETS_PER_OCTAVE
    return -(-rows // step) * step


class Linear:
    """``y = x W^T + b``; on CPU (fp32) through oneDNN with the weight packed once at load time.

    ``F.linear`` on CPU hands MKL the weight in its checkpoint layout and it is re-blocked on
    every call, which dominates at decode batch sizes; prepacked, small batches run several times
    faster and large ones alike. Results agree to ~1e-6 relative.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if _onednn_ok(weight):
            # The batch size is only a blocking hint; any number of rows is accepted later.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            self.weight = None  # the packed copy replaces it (a tied embedding keeps its own)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            padded = row_bucket(rows)
            if padded != rows:  # zero rows up to the bucket (see `row_bucket`); sliced off below
                x = F.pad(x, (0, 0, 0, padded - rows))
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y if padded == rows else y[:rows]
        assert self.weight is not None  # only dropped once `packed` replaces it
        return F.linear(x, self.weight, self.bias)
