"""Continuous batching: each step decides ``{request_id: num_new_tokens}`` and runs it.

No prefill/decode phases (vLLM v1 style): a request is only ``num_computed_tokens`` behind its
``num_tokens``; running requests are served first, then waiting ones FCFS, all under one token
budget, so a step freely mixes decodes with prefill chunks. When blocks run out, the most
recently admitted running request is preempted by recompute.

Prefix caching (``SchedulerConfig.enable_prefix_caching``, on by default): a request being
admitted starts from the longest run of its leading full blocks found in the cache (shared by
reference count, never the block holding its last token), so it computes only the rest; after
each successful step the blocks its computed tokens filled are registered. A preempted or
aborted request's blocks stay cached until they are needed, so recompute after preemption is
mostly a cache hit. Counters, in tokens, over admissions: ``prefix_cache_queries`` and
``prefix_cache_hits``.

Faults: `reset_executor` moves every request to a new executor (all running ones preempted and
recomputed there, so no token is lost or changed). After a step that failed, `isolate` runs the
step's requests one at a time until each has passed a step alone; the one that fails alone is
the culprit and is failed by the caller (``abort(id, "error")``), while the others go on.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from common.batch import Batch, ExecutorOutput
from common.config import ExecutorInfo, SchedulerConfig
from scheduler.cache_manager import CacheManager
from scheduler.request import Request, RequestStatus, StepOutput

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """What the scheduler needs from a `ModelExecutor` (in-process or behind a stream)."""

    info: ExecutorInfo

    def execute_model(self, batch: Batch) -> ExecutorOutput: ...


class Scheduler:
    """Owns the waiting/running queues; drives the cache manager and the executor."""

    def __init__(self, config: SchedulerConfig, cache_manager: CacheManager, executor: Executor) -> None:
        self.config = config
        self.cache = cache_manager
        self.executor = executor
        self.max_model_len = executor.info.max_model_len
        self.eos_token_ids = frozenset(executor.info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self.prefix_cache_queries = 0  # tokens of admitted requests (each admission counts)
        self.prefix_cache_hits = 0  # of which found in the prefix cache
        # Requests of a failed step, still to pass one step alone (in order); see `isolate`.
        self.suspects: list[str] = []
        assert cache_manager.block_size == executor.info.block_size

    def reset_executor(self, executor: Executor, cache_manager: CacheManager) -> None:
        """Carry on with another executor and KV pool: running requests are preempted (recompute)."""
        self.preempt_all()
        assert cache_manager.block_size == executor.info.block_size
        for request in self.requests.values():
            request.block_hashes.clear()  # they depend on the block size, which may change
        self.executor = executor
        self.cache = cache_manager
        self.max_model_len = executor.info.max_model_len
        self.eos_token_ids = frozenset(executor.info.eos_token_ids)

    def preempt_all(self) -> None:
        """Preempt every running request (their KV is gone or untrusted); order is kept."""
        for request in reversed(self.running):
            self._preempt(request)
        self.running.clear()

    def isolate(self, request_ids: list[str]) -> None:
        """Run these requests (of a step that failed) one per step until each has passed alone."""
        self.suspects = [r for r in request_ids if r in self.requests]

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request (prompt shorter than ``max_model_len``, unique id)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens (with any earlier output), more than "
                f"max_model_len ({self.max_model_len})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, reason: str = "abort") -> StepOutput | None:
        """Finish ``request_id`` at once and free its blocks; None if it is unknown.

        ``reason`` "error" fails a request that made a step fail alone (see `isolate`)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason)
        return StepOutput(request_id, [], [], True, reason, request.num_output_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.cache.free(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    # -- one engine step --------------------------------------------------------------------
    def decide(self) -> dict[str, int]:
        """Pick this step's ``{request_id: num_new_tokens}`` and allocate their blocks."""
        self.suspects = [r for r in self.suspects if r in self.requests]
        if self.suspects:
            return self._decide_alone(self.requests[self.suspects[0]])
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            assert n >= 1, "running request with nothing to compute"
            while not self.cache.allocate_slots(request.request_id, request.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            scheduled[request.request_id] = n
            budget -= n
            i += 1
        # Admitting while preempting would only thrash: the freed blocks go to running requests.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            admitted = self._admit_blocks(request, budget)
            if admitted is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = admitted
            budget -= admitted
        return scheduled

    def _admit_blocks(self, request: Request, budget: int) -> int | None:
        """Allocate a waiting request's first chunk, after its prefix-cache hit; its size, or None.

        On success ``num_computed_tokens`` is the hit length (0 without prefix caching)."""
        assert request.num_computed_tokens == 0, "a waiting request has nothing computed"
        if self.config.enable_prefix_caching:
            hit_blocks, hit_tokens = self.cache.get_computed_blocks(request)
        else:
            hit_blocks, hit_tokens = [], 0
        n = min(request.num_tokens - hit_tokens, budget)
        if not self.cache.allocate_slots(request.request_id, hit_tokens + n, hit_blocks):
            return None
        request.num_computed_tokens = hit_tokens
        if self.config.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit_tokens
        return n

    def _decide_alone(self, request: Request) -> dict[str, int]:
        """Schedule ``request`` alone; other running requests wait (keeping their blocks)."""
        budget = self.config.max_num_batched_tokens
        while True:
            if request.status is RequestStatus.WAITING:
                n = self._admit_blocks(request, budget)
            else:
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                if not self.cache.allocate_slots(request.request_id, request.num_computed_tokens + n):
                    n = None
            if n is not None:
                break
            victim = next(r for r in reversed(self.running) if r is not request)  # the pool holds one max-length request
            self.running.remove(victim)
            self._preempt(victim)
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return {request.request_id: n}

    def build_batch(self, scheduled: dict[str, int]) -> Batch:
        """Flatten the scheduled requests into a `Batch` (plain lists; no tensors here)."""
        batch = Batch()
        block_size = self.cache.block_size
        for request_id, n in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            end = start + n
            table = self.cache.get_block_table(request_id)
            batch.request_ids.append(request_id)
            batch.input_ids.extend(request.tokens_between(start, end))
            batch.positions.extend(range(start, end))
            batch.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            batch.query_lens.append(n)
            batch.seq_lens.append(end)
            batch.block_tables.append(list(table))
            batch.sample.append(end == request.num_tokens)
            batch.output_lens.append(request.num_output_tokens)
            batch.sampling_params.append(request.sampling_params)
        return batch

    def schedule(self) -> list[StepOutput]:
        """Run one engine step: decide, build the batch, execute it, apply the sampled tokens."""
        scheduled = self.decide()
        if not scheduled:
            # With a pool that holds max_model_len tokens, a live request can always be scheduled.
            assert not self.requests, "scheduler stalled with live requests"
            return []
        batch = self.build_batch(scheduled)
        result = self.executor.execute_model(batch)
        self.num_steps += 1
        if self.suspects and self.suspects[0] in scheduled:
            self.suspects.pop(0)  # it passed a step alone
        return self.apply(batch, result)

    def apply(self, batch: Batch, result: ExecutorOutput) -> list[StepOutput]:
        """Advance each scheduled request, append sampled tokens and check stop conditions."""
        outputs: list[StepOutput] = []
        finished: list[Request] = []
        caching = self.config.enable_prefix_caching
        block_size = self.cache.block_size
        for i, request_id in enumerate(batch.request_ids):
            request = self.requests.get(request_id)
            if request is None:  # aborted while the step ran
                continue
            start = request.num_computed_tokens
            request.num_computed_tokens += batch.query_lens[i]
            if caching and start % block_size + batch.query_lens[i] >= block_size:
                self.cache.cache_full_blocks(request)  # a block filled up and the step succeeded
            if not batch.sample[i]:
                continue
            token = result.token_ids[i]
            logprobs = result.logprobs[i] if result.logprobs else None
            request.output_token_ids.append(token)
            request.output_logprobs.append(logprobs)
            reason = self._stop_reason(request, token)
            if reason is not None:
                finished.append(request)
                request.finish_reason = reason
            outputs.append(
                StepOutput(request_id, [token], [logprobs], reason is not None, reason, request.num_output_tokens)
            )
        for request in finished:
            self.running.remove(request)
            self._finish(request, request.finish_reason or "stop")
        return outputs

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        n = request.num_output_tokens
        if n >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
        if n >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None
