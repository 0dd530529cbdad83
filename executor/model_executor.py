"""`ModelExecutor`: owns the model, its paged KV cache, the sampler and the persistent batch.

`execute_model` takes one `SchedulerOutput` (the scheduler's step, as a delta), lets the
`PersistentBatch` turn it into a `Batch`, runs the forward pass and sampling, and appends the
sampled tokens to the requests' state so that a step scheduled one ahead reads them. It is
`launch` then `collect`: a caller with the next step at hand launches it before collecting the
one before, so that the host prepares step N+1 while the device runs step N (`launch` says when
the host waits for step N's tokens first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import DEFAULT_MAX_NUM_SEQS, CacheConfig, ExecutorInfo, ModelConfig, ParallelConfig
from common.protocol import ExecutorOutput, SchedulerOutput
from common.sampling_params import SamplingParams
from executor.attention_metadata import AttentionMetadata
from executor.backends import get_ops
from executor.cpu_decode import CpuDecodeKernel, make_cpu_decode_kernel
from executor.cuda_graphs import CudaGraphRunner
from executor.grammar import GrammarMask, StructuredDecoding
from executor.input_batch import Batch, PersistentBatch
from executor.kv_groups import kv_group_layout
from executor.loader import load_weights
from executor.model_config import HFModelConfig, load_config
from executor.models.registry import family_of
from executor.parallel import TensorParallel
from executor.penalties import BadWords, TokenCountPool, TokenCounts
from executor.prompt_logprobs import prompt_logits, prompt_logprobs_of
from executor.sampler import Sampler
from executor.shard_loader import load_shard
from executor.threads import configure_cpu_threads, resolve_num_threads

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, CPU default when CacheConfig.kv_cache_memory is None
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _to(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device`` (on the CPU, sharing its memory when the
    dtypes match). To a GPU it goes through pinned memory, so the copy does not wait for the
    device (the caching host allocator keeps the pinned block until the copy is done)."""
    tensor = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)


@dataclass(slots=True, eq=False)  # compared by identity: each launch is one step
class LaunchedStep:
    """One step launched by `ModelExecutor.launch`, for `ModelExecutor.collect`.

    ``n``: the step's sequences; ``idx``: those that sample, in order; ``uids``, ``at`` and
    ``rows``: per sampling sequence, its request (`PersistentBatch.row_uid`), the position its
    token takes, and its row while the batch's ``layout`` is what it was at launch.
    ``tokens``: the sampled tokens (per ``idx``) once on the host. Until then ``sampled`` holds them
    on the device and, on a GPU, ``host`` is their pinned copy, complete when ``event`` is.
    """

    n: int = 0
    idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    uids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    layout: int = -1
    tokens: np.ndarray | None = None
    sampled: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: Any = None
    logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs: list[list[dict[int, float] | None] | None] = field(default_factory=list)

    @property
    def on_device(self) -> bool:
        """Whether its tokens are still to be read back."""
        return self.tokens is None


@dataclass(slots=True)
class Placeholders:
    """Input tokens of a step that are the tokens ``source`` sampled, not read back yet: input
    token ``token_index[i]`` is ``source``'s sampled token ``sampled_index[i]`` (in ``source.idx``'s order)."""

    source: LaunchedStep
    token_index: np.ndarray
    sampled_index: np.ndarray


def resolve_device_dtype(model_config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """``auto`` means CUDA + bf16 when a GPU is present, else CPU + fp32."""
    if model_config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(model_config.device)
    if model_config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif model_config.dtype in _DTYPES:
        dtype = _DTYPES[model_config.dtype]
    else:
        raise ValueError(f"unknown dtype {model_config.dtype!r}; expected auto, {', '.join(_DTYPES)}")
    return device, dtype


def kv_block_bytes(cfg: HFModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of one KV block (K and V) across ``num_layers`` layers (default: all of them)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelExecutor:
    """Loads a checkpoint, sizes and allocates the KV pool, and executes batches.

    With ``tp`` it is one rank of a tensor-parallel executor (`executor.tp_executor` builds them):
    it loads only its shard, its KV pool holds its KV heads, and ranks > 0 take the tokens rank 0
    samples. ``max_num_seqs`` bounds the decode batch sizes captured as CUDA graphs.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        parallel_config: ParallelConfig,
        cache_config: CacheConfig | None = None,
        tp: TensorParallel | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    ) -> None:
        cache_config = cache_config or CacheConfig()
        # Every option up front, with a clear ValueError, before a byte of the model is read.
        model_config.validate()
        parallel_config.validate()
        cache_config.validate()
        world = parallel_config.tensor_parallel_size
        if (tp.world if tp is not None else 1) != world:
            raise ValueError(f"tensor_parallel_size={world}: build the executor with executor.tp_executor.build_executor")
        # Ranks share the CPUs: by default each takes its share of them.
        threads = model_config.num_threads or (max(1, resolve_num_threads() // world) if world > 1 else None)
        self.num_threads = configure_cpu_threads(threads)
        self.model_config = model_config
        self.cache_config = cache_config
        self.tp = tp
        model_dir = Path(model_config.model)
        self.device, self.dtype = resolve_device_dtype(model_config)
        if tp is not None:
            self.device = tp.device
        self.hf_config = cfg = load_config(model_dir)
        # What this rank holds (all of it without tensor parallelism).
        local = tp.layout.local_config(cfg) if tp is not None else cfg

        max_len = model_config.max_model_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}")
        self.max_model_len = max_len

        backend = model_config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.ops = get_ops(backend)

        torch.manual_seed(model_config.seed)
        if tp is None:
            weights = load_weights(model_dir, cfg, self.dtype, self.device)
        else:
            weights = load_shard(model_dir, cfg, tp.layout, self.dtype, self.device)
        self.model = family_of(cfg).build(local, weights, self.ops, max_pos=cfg.max_position_embeddings, tp=tp)
        del weights

        self.block_size = cache_config.block_size
        # A hybrid model's KV-cache groups (`executor.kv_groups`): a block is one layer slot's.
        self.kv_groups = kv_group_layout(cfg)
        # The budget is per rank (each holds its KV heads); all ranks take the smallest pool.
        self.num_blocks = self._num_blocks(local)
        if tp is not None:
            self.num_blocks = tp.min_int(self.num_blocks)
        # With a window, one block more than the pool: the scheduler's null block (id
        # ``num_blocks``), which stands for blocks out of the window and is never written.
        null = 0 if cfg.kv_window is None and self.kv_groups is None else 1
        shape = (self.num_blocks + null, self.block_size, local.num_kv_heads, cfg.head_dim)
        # Zero-filled: masked-out keys/values must be finite (0 x NaN would poison attention).
        slots = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers if self.kv_groups is None else self.kv_groups.num_slots)
        ]
        # Per layer, its K/V tensors: its own, or its slot's, shared with the other groups.
        self.kv_caches = slots if self.kv_groups is None else [slots[j] for j in self.kv_groups.layer_slot]
        self.sampler = Sampler(self.device, seed=model_config.seed)
        self.token_counts = TokenCountPool(cfg.vocab_size, self.device)  # penalties' statistics
        self.info = ExecutorInfo(
            model_name=model_dir.resolve().name,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(cfg.eos_token_ids),
            vocab_size=cfg.vocab_size,
            sliding_window=cfg.kv_window,
            kv_group_windows=[] if self.kv_groups is None else [w or 0 for w in self.kv_groups.windows],
        )
        self.backend = backend
        num_groups = 1 if self.kv_groups is None else self.kv_groups.num_groups
        self.input_batch = PersistentBatch(self.block_size, cfg.vocab_size, num_groups)
        self._pending: list[LaunchedStep] = []  # launched, tokens still on the device (`launch`)
        self.structured = StructuredDecoding(model_dir, cfg.vocab_size, list(cfg.eos_token_ids), self.device)
        self.graphs: CudaGraphRunner | None = None
        # Graphs need kernels that read every size from device tensors: the Triton backend's. Not
        # with tensor parallelism yet: ranks would capture NCCL all-reduces in lockstep, a path no
        # multi-GPU machine has run (docs/parallelism.md).
        # Nor with KV-cache groups yet: the graphs' static buffers hold one table per sequence.
        graphable = world == 1 and self.kv_groups is None
        if self.device.type == "cuda" and backend == "triton" and not model_config.enforce_eager and graphable:
            self.graphs = CudaGraphRunner(
                lambda ids, pos, meta: self.model.forward(ids, pos, self.kv_caches, meta),
                max_num_seqs,
                -(-self.max_model_len // self.block_size),
                self.device,
                max_seq_len=self.max_model_len,
            )
            self.graphs.capture()
        # Decode steps of a few rows in C on CPU (`executor.cpu_decode`); the same limits as graphs.
        self.cpu_decode: CpuDecodeKernel | None = None
        if self.device.type == "cpu":
            unsupported = "tensor parallel" if world > 1 else "KV-cache groups" if self.kv_groups is not None else None
            self.cpu_decode = make_cpu_decode_kernel(model_config.cpu_decode_kernel, self.model, self.kv_caches, unsupported)
        log.info(
            "executor ready: %s on %s/%s, backend %s, %d KV blocks x %d tokens, tensor parallel %d, cuda graphs %s",
            self.info.model_name,
            self.device,
            self.dtype,
            backend,
            self.num_blocks,
            self.block_size,
            world,
            "on" if self.graphs is not None else "off",
        )

    def _num_blocks(self, cfg: HFModelConfig) -> int:
        """The pool's size in blocks. With KV-cache groups a block holds one layer slot's K/V
        (a group's layers), and ``num_blocks`` in the config still means that many blocks of
        every layer's memory; a full-length sequence needs a table in every group."""
        groups = self.kv_groups
        block_bytes = kv_block_bytes(cfg, self.block_size, self.dtype, None if groups is None else groups.num_slots)
        per_seq = 1 if groups is None else groups.num_groups
        cc = self.cache_config
        if cc.num_blocks is not None:
            budget, what = cc.num_blocks * kv_block_bytes(cfg, self.block_size, self.dtype), "num_blocks"
            num_blocks = budget // block_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # What this process may still use under the utilisation cap, less headroom for
            # activations and the allocator.
            budget = int(total * cc.gpu_memory_utilization) - (total - free) - (512 << 20)
            num_blocks, what = max(budget, 0) // block_bytes, f"gpu_memory_utilization={cc.gpu_memory_utilization}"
        else:
            budget = cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
            num_blocks, what = budget // block_bytes, "kv_cache_memory"
        holds = num_blocks // per_seq * self.block_size
        if holds < self.max_model_len:
            need = -(-self.max_model_len // self.block_size) * per_seq
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks x {self.block_size} tokens hold {holds} tokens, "
                f"fewer than max_model_len={self.max_model_len} (one full-length sequence). The pool "
                f"({what}) gives {budget} bytes at {block_bytes} bytes per block; at least "
                f"{need * block_bytes} bytes ({need} blocks) are needed. Raise the KV memory or lower "
                f"max_model_len."
            )
        return int(num_blocks)

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Tensors and attention metadata of ``batch``, built once for the whole step (from its
        arrays, whole: no loop over its tokens or blocks)."""
        dev = self.device
        qsl = np.zeros(batch.num_seqs + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=qsl[1:])
        groups = self.kv_groups
        num_groups = 1 if groups is None else groups.num_groups
        tables = batch.block_tables
        if tables.shape[1] < num_groups:  # at least one block per sequence (and group)
            tables = np.zeros((tables.shape[0], num_groups), dtype=np.int32)
        if groups is not None:  # [group][sequence][block] from the interleaved tables
            tables = np.stack([tables[:, g::num_groups] for g in range(num_groups)])
        block_tables = _to(tables, torch.int32, dev)
        slot_mapping = _to(batch.slot_mapping, torch.int64, dev)
        seq_lens_list: list[int] = batch.seq_lens.tolist()
        query_lens_list: list[int] = batch.query_lens.tolist()
        meta = AttentionMetadata(
            query_start_loc=_to(qsl, torch.int32, dev),
            seq_lens=_to(batch.seq_lens, torch.int32, dev),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=max(query_lens_list),
            max_seq_len=max(seq_lens_list),
            query_lens_list=query_lens_list,
            seq_lens_list=seq_lens_list,
        )
        if groups is not None:
            # One metadata per group (its tables and slots; the rest shared), each layer its group's.
            slots = slot_mapping.view(num_groups, -1)
            per_group = [
                AttentionMetadata(
                    meta.query_start_loc,
                    meta.seq_lens,
                    block_tables[g],
                    slots[g],
                    meta.max_query_len,
                    meta.max_seq_len,
                    meta.query_lens_list,
                    meta.seq_lens_list,
                )
                for g in range(num_groups)
            ]
            meta = per_group[0]
            meta.per_layer = [per_group[g] for g in groups.layer_group]
        input_ids = _to(batch.input_ids, torch.int64, dev)
        positions = _to(batch.positions, torch.int64, dev)
        sample_rows: list[int] = (qsl[1:][batch.sample] - 1).tolist()
        return input_ids, positions, meta, sample_rows

    @property
    def launch_returns_early(self) -> bool:
        """Whether `launch` returns with the step queued on the device (so collecting the step
        before after it overlaps the two); on CPU it returns with the step run."""
        return self.device.type == "cuda"

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        """Run one scheduled step; on any error every request's state is dropped (and re-raised):
        the scheduler then resends them all as new."""
        return self.collect(self.launch(output))

    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """Start one scheduled step: its inputs, forward pass and sampling are queued on the
        device, and its sampled tokens are read back by `collect` (collect steps in launch order).

        A step launched before the previous one is collected reads that step's tokens on the device:
        its rows whose input is a token the previous step sampled get a placeholder, filled on the
        device from the previous step's sampled tensor. The rule for when the host waits instead:
        a step leaves its tokens on the device only when sampling it is one greedy argmax
        (`Batch.plain`) and there is no tensor parallelism; any other step (grammars, bad words,
        ``min_tokens``, allowed token ids, penalties, logprobs, prompt logprobs, or tensor
        parallelism: ranks share tokens on the host) first reads the previous step's tokens back
        and samples on the host. The executor checks no stop conditions (the scheduler does), so
        nothing else needs them. On any error every request's state is dropped (and re-raised).
        """
        grammar: GrammarMask | None = None
        try:
            # Only the step launched last may still hold its tokens on the device.
            for old in self._pending[:-1]:
                self._read_back(old)
            batch = self.input_batch.prepare(output)
            holes = self._placeholders(batch)
            overlap = self.tp is None and batch.plain and not batch.prompt_lp
            if holes is not None and not overlap:
                self._read_back(holes.source)
                batch.input_ids[holes.token_index] = holes.source.tokens[holes.sampled_index]  # type: ignore[index]
                holes = None
            # The structured-output masks are filled on a worker thread while the forward pass runs,
            # on the rank that samples (ranks > 0 take its tokens: their masks went unused).
            if (self.tp is None or self.tp.rank == 0) and not batch.plain:
                grammar = self.structured.start(batch, self.input_batch.requests)
            launched = self._run(batch, grammar, holes, keep_on_device=overlap)
            column = np.zeros(batch.num_seqs, dtype=np.int64)  # placeholders until read back
            if launched.tokens is not None:
                column[launched.idx] = launched.tokens
            else:
                self._pending.append(launched)
            self.input_batch.append_sampled(batch, column)
        except BaseException:
            if grammar is not None:
                grammar.future.exception()  # the worker is done with the matchers before they are dropped
            self.reset()
            raise
        return launched

    def collect(self, launched: LaunchedStep) -> ExecutorOutput:
        """The result of a launched step (waiting for its tokens if need be); on any error every
        request's state is dropped (and re-raised)."""
        try:
            self._read_back(launched)
        except BaseException:
            self.reset()
            raise
        return self._output(launched)

    def _placeholders(self, batch: Batch) -> Placeholders | None:
        """The input tokens of ``batch`` that the last launched step sampled and left on the device."""
        if not self._pending or not len(batch.rows):
            return None
        source = self._pending[-1]  # (a step left on the device sampled at least one row)
        uids = self.input_batch.row_uid[batch.rows]
        order = np.argsort(source.uids)
        j = order[np.minimum(np.searchsorted(source.uids[order], uids), len(order) - 1)]
        start, at = batch.seq_lens - batch.query_lens, source.at[j]
        hit = (source.uids[j] == uids) & (start <= at) & (at < batch.seq_lens)
        if not hit.any():
            return None
        qsl = np.cumsum(batch.query_lens) - batch.query_lens
        return Placeholders(source, (qsl + at - start)[hit], j[hit])

    def _read_back(self, launched: LaunchedStep) -> None:
        """Bring a launched step's tokens to the host and into the requests' state (once)."""
        if launched.tokens is None:
            if launched.event is not None:
                launched.event.synchronize()
                tokens = launched.host.numpy().copy()  # type: ignore[union-attr]
            else:
                tokens = launched.sampled.numpy().astype(np.int64)  # type: ignore[union-attr]
            launched.tokens, launched.sampled, launched.host, launched.event = tokens, None, None, None
            self.input_batch.fill_sampled(launched.uids, launched.at, tokens, launched.rows, launched.layout)
        if launched in self._pending:
            self._pending.remove(launched)

    def _output(self, launched: LaunchedStep) -> ExecutorOutput:
        column = np.full(launched.n, -1, dtype=np.int64)
        assert launched.tokens is not None
        column[launched.idx] = launched.tokens
        lps = launched.logprobs
        logprobs: list[dict[int, float] | None] = []
        if lps is not None:
            logprobs = [None] * launched.n
            for j, i in enumerate(launched.idx.tolist()):
                logprobs[i] = lps[j]
        return ExecutorOutput(column.tolist(), logprobs, launched.prompt_logprobs)

    def reset(self) -> None:
        """Drop every request's state (after a failed step, or a new binding)."""
        self._pending.clear()
        self.input_batch.clear()
        self.token_counts.clear()

    def check_device(self) -> None:
        """Raise if the device is unusable (after a failed step): a CUDA error such as an illegal
        memory access is sticky, and every later step on this process would fail too."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).item()

    def execute_batch(self, batch: Batch, grammar: GrammarMask | None = None) -> ExecutorOutput:
        """Run one forward pass over ``batch`` and sample the rows that finish a prompt or decode;
        ``grammar``: the masks of its structured-output rows (`StructuredDecoding.start`)."""
        return self._output(self._run(batch, grammar, None, keep_on_device=False))

    def _run(self, batch: Batch, grammar: GrammarMask | None, holes: Placeholders | None, keep_on_device: bool) -> LaunchedStep:
        """Run one forward pass over ``batch`` and sample the rows that finish a prompt or decode;
        ``holes``: its input tokens to take from the previous step's sampled tensor on the device.
        With ``keep_on_device`` (a plain batch) the greedy tokens stay on the device, a copy to the
        host on its way behind an event (`LaunchedStep`); otherwise they are on the host on return.

        With tensor parallelism every rank runs the forward pass and the logits' all-gathers, and
        rank 0 alone samples and computes prompt logprobs, then shares the tokens: the phases of
        `TensorParallel` mark where an error leaves the ranks out of step."""
        tp = self.tp
        n = batch.num_seqs
        idx = np.flatnonzero(batch.sample)
        sampled_rows = batch.rows[idx] if len(batch.rows) else np.zeros(0, dtype=np.int64)
        launched = LaunchedStep(
            n,
            idx,
            self.input_batch.row_uid[sampled_rows],
            batch.seq_lens[idx] if n else np.zeros(0, dtype=np.int64),
            sampled_rows,
            self.input_batch.layout,
        )
        if n == 0:
            if tp is not None:
                tp.end_step()
            launched.tokens = np.zeros(0, dtype=np.int64)
            return launched
        longest = int(batch.seq_lens.max())
        if longest > self.max_model_len:
            raise ValueError(f"sequence of {longest} tokens exceeds max_model_len={self.max_model_len}")
        ids = batch.input_ids
        if batch.num_tokens and not (0 <= ids.min() and ids.max() < self.info.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.info.vocab_size}), got {ids.min()}..{ids.max()}")
        num_sampled = len(idx)
        with torch.inference_mode():
            if tp is not None:
                tp.enter_collectives()
            input_ids, positions, meta, rows = self._prepare(batch)
            if holes is not None:
                source = holes.source.sampled
                assert source is not None
                at = _to(holes.token_index, torch.int64, self.device)
                input_ids.index_copy_(0, at, source.index_select(0, _to(holes.sampled_index, torch.int64, self.device)))
            hidden = self.graphs.run(input_ids, positions, meta) if self.graphs is not None else None
            if hidden is None and self.cpu_decode is not None:
                hidden = self.cpu_decode.run(input_ids, positions, meta, head=len(rows) == input_ids.shape[0])
            if hidden is None:
                hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
            plp_logits = prompt_logits(self.model, hidden, batch) if batch.prompt_lp else None
            logits = None
            if rows:
                if len(rows) < hidden.shape[0]:
                    hidden = hidden.index_select(0, _to(np.asarray(rows), torch.int64, self.device))
                logits = self.cpu_decode.logits(hidden) if self.cpu_decode is not None else None
                if logits is None:
                    logits = self.model.compute_logits(hidden)
            if tp is not None and tp.rank != 0:  # rank 0 samples; the others follow it
                if not num_sampled:
                    tp.end_step()
                    launched.tokens, launched.logprobs = np.zeros(0, dtype=np.int64), []
                    return launched
                launched.tokens = np.asarray(tp.share_tokens(None, num_sampled), dtype=np.int64)
                launched.logprobs = [None] * num_sampled  # (rank 0's are the step's)
                return launched
            if logits is None:
                if tp is not None:
                    tp.end_step()  # the other ranks are done with this step
                launched.tokens, launched.logprobs = np.zeros(0, dtype=np.int64), []
                launched.prompt_logprobs = prompt_logprobs_of(plp_logits, batch) if plp_logits is not None else []
                return launched
            if keep_on_device and batch.plain:
                launched.sampled = logits.argmax(dim=-1)
                if self.device.type == "cuda":
                    launched.host = torch.empty(num_sampled, dtype=torch.int64, pin_memory=True)
                    launched.host.copy_(launched.sampled, non_blocking=True)
                    launched.event = torch.cuda.Event()
                    launched.event.record()
                return launched
            try:
                launched.prompt_logprobs = prompt_logprobs_of(plp_logits, batch) if plp_logits is not None else []
                sampled, launched.logprobs = self._sample(batch, idx.tolist(), logits, grammar)
            except BaseException:
                if tp is not None:  # the other ranks wait for these tokens: tell them
                    tp.share_tokens(None, num_sampled)
                raise
            if tp is not None:
                tp.share_tokens(sampled, num_sampled)
        launched.tokens = np.asarray(sampled, dtype=np.int64).reshape(-1)
        return launched

    def _sample(
        self, batch: Batch, idx: list[int], logits: torch.Tensor, grammar: GrammarMask | None
    ) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """Tokens (and logprobs, None when no row asks) of the sampled rows ``idx`` of ``batch``,
        from their ``logits`` (``grammar``: the masks of its structured-output rows)."""
        if batch.plain:  # greedy, nothing else asked: the argmax is all there is to do
            return logits.argmax(dim=-1).tolist(), None
        params = [batch.sampling_params[i] for i in idx]
        out_lens: list[int] = batch.output_lens[idx].tolist()
        banned, allowed = self._constraints(batch, idx, params, out_lens)
        counts: TokenCounts | None = None
        step = batch.token_counts
        if step is not None:  # some sampled request has penalties
            self.token_counts.update(step)
            rows = [j for j, i in enumerate(idx) if step.slots[i] >= 0]
            counts = self.token_counts.gather(rows, [step.slots[idx[j]] for j in rows])
        return self.sampler.sample(logits, params, out_lens, banned, counts, grammar, allowed)

    def _constraints(
        self, batch: Batch, idx: list[int], params: list[SamplingParams], out_lens: list[int]
    ) -> tuple[list[list[int]] | None, list[torch.Tensor | None] | None]:
        """Per sampled row ``idx`` of ``batch`` (``params``, ``out_lens``: theirs): what it may not
        produce this step, and the only tokens it may produce (on the device, copied there once per
        request); None for all rows when none has any.

        Banned: EOS and stop tokens while a request is below its ``min_tokens`` (not under a
        grammar: when it is complete, EOS is all it allows), and the last token of each bad word
        whose other tokens end the output."""
        banned: list[list[int]] | None = None
        allowed: list[torch.Tensor | None] | None = None
        for j, p in enumerate(params):
            if not (p.min_tokens or p.bad_words_token_ids or p.allowed_token_ids):
                continue  # (most rows: one test each)
            ban: list[int] = []
            if out_lens[j] < p.min_tokens and p.structured_outputs is None:
                ban = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.info.eos_token_ids))
            state = self.input_batch.requests[batch.request_ids[idx[j]]]
            if p.bad_words_token_ids:
                if state.bad_words is None:
                    state.bad_words = BadWords(p.bad_words_token_ids)
                bad = state.bad_words.bans(state.token_ids, out_lens[j])
                # Bans that leave no allowed token are lifted (`Sampler.sample`); min_tokens' first.
                if ban and p.allowed_token_ids is not None and set(p.allowed_token_ids) <= set(ban + bad):
                    ban = []
                ban += bad
            if ban:
                if banned is None:
                    banned = [[] for _ in idx]
                banned[j] = ban
            if p.allowed_token_ids is not None:
                if state.allowed is None:
                    state.allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=self.device)
                if allowed is None:
                    allowed = [None] * len(idx)
                allowed[j] = state.allowed
        return banned, allowed

    def shutdown(self) -> None:
        """Free the KV cache and weights."""
        self.cpu_decode = None  # it points into the caches and weights
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
        self.structured.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
