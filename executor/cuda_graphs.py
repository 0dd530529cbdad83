"""CUDA graphs for pure-decode steps: capture once per batch size, pad to the next size, replay.

A decode step of a small batch on a GPU is bound by kernel launches (a few hundred per step), so
the forward pass of a decode-only batch is captured as a CUDA graph for each size of a ladder
(`capture_sizes`: 1, 2, 4, 8, ... up to ``max_num_seqs``) and replayed. A batch of ``n``
sequences runs as the smallest captured size ``>= n`` (`padded_size`); the padding rows write no
KV (slot -1), attend over one key of block 0 and are cut from the output. Each size's attention
takes the split-KV count that the model's longest context asks for at that batch size, so batch
1-8 decode at long contexts replays on most SMs, not on a handful of programs. Prefill and mixed steps,
and decode batches larger than the largest size, run eagerly.

A graph replays fixed device addresses, so its inputs live in static buffers (`GraphInputs`) that
each step copies into (device to device: no host sync), and the kernels read every varying size
from those tensors (the Triton backend does; the torch backend plans on the host and is never
captured). Capture and replay need CUDA (`CudaGraphRunner`); the ladder, the padding and the
buffers are plain torch and tested on CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from executor.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# nano-vllm's and vLLM's ceiling: beyond this a decode step is compute-bound and launches are noise.
MAX_CAPTURE_SIZE = 512

# The forward pass a graph captures: (input_ids, positions, meta) -> hidden [T, hidden].
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: powers of two below ``min(max_num_seqs, limit)``, then that bound."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, limit)
    sizes, b = [], 1
    while b < top:
        sizes.append(b)
        b *= 2
    sizes.append(top)
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size ``>= n``; None when ``n`` exceeds them all (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class GraphInputs:
    """Static input buffers of the decode graphs, for up to ``max_batch`` sequences.

    ``query_start_loc`` of a decode batch is always ``0..b``, so it is written once. `load` copies
    a step's tensors into the first rows and resets the padding rows; every captured graph reads
    prefixes of these same buffers.

    ``max_seq_len`` is the longest context a replay may see: the attention dispatch picks its
    split-KV count from it at capture (a replay cannot change it), so long contexts at small
    batches replay split-KV decode, its workspace sized then; short sequences leave some splits
    empty, which the merge weighs at zero. None: 1, every replay on the 2D kernel.
    """

    __slots__ = (
        "max_batch",
        "max_seq_len",
        "input_ids",
        "positions",
        "slot_mapping",
        "seq_lens",
        "query_start_loc",
        "block_tables",
    )

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device, max_seq_len: int | None = None) -> None:
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or 1
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max(max_blocks_per_seq, 1), dtype=torch.int32, device=device)

    def meta(self, b: int, seq_lens_list: list[int] | None = None) -> AttentionMetadata:
        """Metadata over the first ``b`` rows. ``seq_lens_list`` is for host-planning (CPU) paths
        only; a captured graph never reads host values, so capture passes none (all ones)."""
        lens = seq_lens_list if seq_lens_list is not None else [1] * b
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_lens_list=[1] * b,
            seq_lens_list=lens,
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, b: int) -> AttentionMetadata:
        """Copy a decode step of ``n <= b`` sequences into rows ``:n``; rows ``n:b`` become padding."""
        n = input_ids.shape[0]
        if meta.max_query_len != 1 or meta.num_seqs != n:
            raise ValueError("only decode steps (one token per sequence) run as graphs")
        if not n <= b <= self.max_batch:
            raise ValueError(f"{n} sequences do not fit a padded batch of {b} (buffers hold {self.max_batch})")
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables of {width} blocks exceed the graphs' {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Entries past a sequence's last block are never read: no need to clear them.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # padding: no KV write, one key of block 0, token 0 at position 0
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].zero_()
        return self.meta(b, list(meta.seq_lens_list) + [1] * (b - n))


class CudaGraphRunner:
    """Captured decode graphs of one model on one CUDA device (see the module docstring)."""

    def __init__(
        self,
        forward: Forward,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        max_seq_len: int | None = None,
    ) -> None:
        """``max_seq_len``: the model's longest context, from which each captured size takes its
        split-KV count (`GraphInputs`)."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.inputs = GraphInputs(self.sizes[-1], max_blocks_per_seq, device, max_seq_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse its memory pool)."""
        t0 = time.perf_counter()
        pool = None
        inp = self.inputs
        for b in reversed(self.sizes):
            meta = inp.meta(b)
            self.forward(inp.input_ids[:b], inp.positions[:b], meta)  # warm-up: compile, allocate
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.forward(inp.input_ids[:b], inp.positions[:b], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes, time.perf_counter() - t0)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of a decode step by graph replay; None when the step must run eagerly."""
        if meta.max_query_len != 1 or meta.block_tables.shape[1] > self.inputs.block_tables.shape[1]:
            return None
        b = padded_size(meta.num_seqs, self.sizes)
        if b is None or b not in self.graphs:
            return None
        self.inputs.load(input_ids, positions, meta, b)
        self.graphs[b].replay()
        return self.outputs[b][: meta.num_seqs]
