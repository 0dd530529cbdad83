"""The scheduler's part in recovering from executor faults (see `scheduler.scheduler`, "Faults"):
a new or reset executor (every running request preempted and recomputed, those it cannot serve
failed), and a failed step (its requests isolated, one per step, until the culprit fails alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.cache_manager import CacheManager
from scheduler.request import RequestStatus
from scheduler.request_queue import pick_victim

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from common.config import ExecutorInfo, SchedulerConfig
    from scheduler.request import Request, StepOutput
    from scheduler.request_queue import WaitingQueue


class ExecutorRecovery:
    """`Scheduler`'s methods for executor faults (a mixin: they act on the scheduler's state, its
    attributes and methods named here)."""

    config: SchedulerConfig
    info: ExecutorInfo
    cache: CacheManager
    max_model_len: int
    eos_token_ids: frozenset[int]
    waiting: WaitingQueue
    running: list[Request]
    requests: dict[str, Request]
    suspects: list[str]
    executor_blocks: dict[str, int]
    finished_for_executor: list[str]
    pending: deque[Any]
    abort: Callable[..., StepOutput | None]
    _preempt: Callable[..., None]
    _admit_blocks: Callable[[Request, int], int | None]
    _num_new_tokens: Callable[[Request, int], int]
    _stop_running: Callable[[Request], None]
    _start_running: Callable[[Request], None]

    def reset_executor(self, info: ExecutorInfo, cache_manager: CacheManager) -> dict[str, str]:
        """Carry on with another executor and KV pool: running requests are preempted (recompute).
        Those it cannot serve (a shorter ``max_model_len``, a smaller vocabulary) are failed, and
        returned with why (kept, one would preempt itself forever or fail its steps)."""
        self.executor_lost()
        assert cache_manager.block_size == info.block_size
        for request in self.requests.values():
            request.block_hashes.clear()  # they depend on the block size, which may change
        self.info = info
        self.cache = cache_manager
        self.max_model_len = info.max_model_len
        self.eos_token_ids = frozenset(info.eos_token_ids)
        unfit: dict[str, str] = {}
        for request in list(self.requests.values()):
            try:
                request.check_servable(info.max_model_len, info.vocab_size)
            except ValueError as exc:
                unfit[request.request_id] = str(exc)
                self.abort(request.request_id, "error")
        return unfit

    def executor_lost(self) -> None:
        """The executor dropped every request (it failed, died or was replaced): steps in flight
        will never answer, so every running request is preempted and all are resent as new."""
        self.pending.clear()
        for request in self.requests.values():
            request.num_output_placeholders = 0
        self.preempt_all(counted=False)  # not memory pressure: vLLM's preemption count stays
        self.executor_blocks.clear()
        self.finished_for_executor.clear()

    def preempt_all(self, counted: bool = True) -> None:
        """Preempt every running request (their KV is gone or untrusted); order is kept.
        ``counted``: in ``num_preemptions`` (vLLM's metric counts those memory pressure caused)."""
        for request in reversed(self.running):
            self._preempt(request, counted)
        self.running.clear()

    def step_failed(self, request_ids: list[str]) -> str | None:
        """A step of ``request_ids`` failed (after `executor_lost`). A step of one request that is
        still live convicts it: it is failed (finish reason "error") and returned. Otherwise the
        live ones are isolated (a culprit aborted while its step ran leaves no one to blame)."""
        live = [r for r in request_ids if r in self.requests]
        if len(request_ids) == 1 and live:
            self.abort(live[0], "error")
            return live[0]
        self.isolate(live)
        return None

    def isolate(self, request_ids: list[str]) -> None:
        """Run these requests (of a step that failed) one per step until each has passed alone."""
        self.suspects = [r for r in request_ids if r in self.requests]

    def _decide_alone(self, request: Request) -> dict[str, int]:
        """Schedule ``request`` alone; other running requests wait (keeping their blocks)."""
        budget = self.config.max_num_batched_tokens
        while True:
            if request.status is RequestStatus.WAITING:
                n = self._admit_blocks(request, budget)
            else:
                n = self._num_new_tokens(request, budget)
                if n == 0:
                    return {}  # its last token is on the way
                if not self.cache.allocate_slots(request.request_id, request.num_computed_tokens + n):
                    n = None
            if n is not None:
                break
            victim = pick_victim(self.running, self.waiting.by_priority, spare=request)  # the pool holds one max-length request
            self._stop_running(victim)
            self._preempt(victim)
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self._start_running(request)
        return {request.request_id: n}
