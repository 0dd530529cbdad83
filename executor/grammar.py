"""Structured outputs in the executor: grammar matchers, and each step's token mask computed while
the forward pass runs.

Each request with ``structured_outputs`` gets an llguidance matcher (`GrammarState`), kept with its
other per-request state (`executor.input_batch.CachedRequestState.grammar`). Compiled grammars are
cached by spec (`GrammarCompiler`): a new request deep-copies a compiled matcher.

Per step, `StructuredDecoding.start` (before the forward) collects the sampling rows with a grammar,
and on a worker thread compiles the grammars of new requests (the llguidance tokenizer too, on
first use), feeds each matcher the tokens it has not seen yet (the one sampled last
step; a whole output when a request is resent after preemption or a reset, so a recomputed request
resumes its grammar where it was) and fills the batch's token bitmask (llguidance's parallel
executor; it releases the GIL, so the forward pass runs meanwhile). `GrammarMask.apply` (in the
sampler) joins it and masks the logits of those rows in one batched operation on the device.

A matcher that cannot compile (validated at the gateway, so this is a backstop) or that falls into
an error state lets its request produce only EOS: that request ends, never the step. When a
grammar is complete llguidance's mask allows only EOS too, so the request ends with "stop".
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.structured_outputs import StructuredOutputsParams, grammar_limits, on_grammar_stack

log = logging.getLogger(__name__)

# Compiled grammars kept per executor (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 128


@dataclass(slots=True)
class GrammarState:
    """One request's grammar: its spec, its matcher (made on the worker thread at the request's first
    mask; None if the grammar did not compile) and how many of its output tokens it has consumed."""

    spec: StructuredOutputsParams
    matcher: Any = None
    compiled: bool = False
    num_consumed: int = 0


class GrammarCompiler:
    """Builds the llguidance tokenizer of a checkpoint (once, on first use) and compiles specs into
    matchers, caching each compiled grammar by `StructuredOutputsParams.key`."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            text = (self.model_dir / "tokenizer.json").read_text()
            self._tokenizer = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    def new_matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher for ``spec`` (None, logged, when it cannot compile)."""
        key = spec.key()
        if key in self._cache:
            self._cache.move_to_end(key)
            template = self._cache[key]
        else:
            template = self._compile(spec)
            self._cache[key] = template
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return None if template is None else template.deep_copy()

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        try:
            grammar, tokenizer = spec.llguidance_grammar(), self.tokenizer()
            matcher = on_grammar_stack(lambda: LLMatcher(tokenizer, grammar, log_level=0, limits=grammar_limits()))
        except Exception as exc:  # a bad spec, or no usable tokenizer: that request only ends
            log.warning("structured output grammar failed to compile: %s", exc)
            return None
        if matcher.is_error():
            log.warning("structured output grammar failed to compile: %s", matcher.get_error())
            return None
        return matcher


@dataclass(slots=True)
class GrammarStats:
    """Totals since start: steps with grammar rows, seconds the worker spent advancing matchers and
    filling masks, and seconds sampling waited for it (the part the forward pass did not hide)."""

    steps: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


@dataclass(slots=True)
class GrammarMask:
    """The grammar rows of one step (indices among the sampled rows) and their bitmask, being
    filled on the worker thread until `apply` joins it."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, bit t of row r: token t allowed
    future: Future[None]
    shifts: torch.Tensor  # arange(32) on the logits' device
    stats: GrammarStats

    def wait(self) -> None:
        start = time.perf_counter()
        self.future.result()
        self.stats.wait_s += time.perf_counter() - start

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [N, vocab] with the tokens the grammar rows may not produce at -inf (a new
        tensor); waits for the masks first."""
        self.wait()
        vocab = logits.shape[1]
        bits = self.bitmask.to(logits.device, non_blocking=True)
        allowed = ((bits[:, :, None] >> self.shifts) & 1).bool().flatten(1)[:, :vocab]
        if len(self.rows) == logits.shape[0]:
            return logits.masked_fill(~allowed, float("-inf"))
        index = torch.tensor(self.rows, dtype=torch.int64, device=logits.device)
        return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))


class StructuredDecoding:
    """The executor's structured-output machinery: compiler, mask worker thread, EOS-only mask."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.compiler = GrammarCompiler(model_dir, vocab_size, eos_token_ids)
        self.device = device
        self.words = (vocab_size + 31) // 32
        # The row of a request that may only end: EOS bits set (or every token if the model names no EOS).
        eos = torch.zeros(self.words * 32, dtype=torch.bool)
        eos[list(eos_token_ids) or slice(None)] = True
        self.eos_row = (eos.view(self.words, 32).int() << torch.arange(32, dtype=torch.int32)).sum(1, dtype=torch.int32)
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._pool: ThreadPoolExecutor | None = None
        self._ll_executor: Any = None
        self.stats = GrammarStats()

    def start(self, batch: Any, requests: dict[str, Any]) -> GrammarMask | None:
        """Begin the masks of ``batch``'s sampling rows that have a grammar (None if none does).

        ``requests``: the executor's `CachedRequestState` by id; each gets its `GrammarState` on first use.
        """
        work: list[tuple[GrammarState, list[int]]] = []
        rows: list[int] = []
        j = -1
        for i, request_id in enumerate(batch.request_ids):
            if not batch.sample[i]:
                continue
            j += 1
            spec = batch.sampling_params[i].structured_outputs
            if spec is None:
                continue
            state = requests[request_id]
            if state.grammar is None:
                state.grammar = GrammarState(spec)
            grammar: GrammarState = state.grammar
            start = state.num_prompt_tokens + grammar.num_consumed
            new = state.token_ids[start:]
            grammar.num_consumed += len(new)
            work.append((grammar, new))
            rows.append(j)
        if not work:
            return None
        if self._pool is None:
            from llguidance import LLExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-grammar")
            self._ll_executor = LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        # Pinned on CUDA, so the copy to the device does not stage through pageable memory.
        bitmask = torch.empty((len(work), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        future = self._pool.submit(self._fill, work, bitmask)
        self.stats.steps += 1
        return GrammarMask(rows, bitmask, future, self.shifts, self.stats)

    def _fill(self, work: list[tuple[GrammarState, list[int]]], bitmask: torch.Tensor) -> None:
        """On the worker thread: compile new requests' grammars (cached), advance each matcher by its
        new tokens, then fill the bitmask. The compiler and the matchers are only used here."""
        start = time.perf_counter()
        live: list[tuple[Any, int]] = []
        for k, (grammar, new) in enumerate(work):
            if not grammar.compiled:
                grammar.matcher, grammar.compiled = self.compiler.new_matcher(grammar.spec), True
            matcher = grammar.matcher
            if matcher is not None and new and not matcher.is_error():
                matcher.consume_tokens(new)  # False (and an error state) on a token the grammar rejects
            if matcher is None or matcher.is_error():
                bitmask[k] = self.eos_row
            else:
                live.append((matcher, k))
        if live:
            # The executor's raw call, not `llguidance.torch`'s wrapper: importing that module
            # compiles a kernel with torch.compile (seconds, and a dependency on the compiler).
            self._ll_executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, len(work))
        self.stats.fill_s += time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
