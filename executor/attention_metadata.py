"""Tensors that describe a mixed prefill/decode batch to the attention and KV-write ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the executor from a `common.batch.Batch`.

    Tokens of sequence ``i`` are rows ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v.
    Sequence ``i`` attends causally over its first ``seq_lens[i]`` cached positions; its new
    tokens are the last ``query_lens[i]`` of those, so token ``j`` of the chunk sits at position
    ``seq_lens[i] - query_lens[i] + j``.

    KV-cache groups (a hybrid model): ``per_layer[i]`` is layer i's group's metadata (its own
    ``block_tables`` and ``slot_mapping``, the rest shared); None: every layer uses this one.

    ``derived``: device tensors an op derives from this step's host lists, made by the first layer
    that needs them and reused by the others (e.g. the attention kernels' work lists).
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1] (cu_seqlens_q)
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 = skip
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU paths can loop without device syncs.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    per_layer: list[AttentionMetadata] | None = None
    derived: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)
