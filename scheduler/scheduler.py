"""Continuous batching: each step decides ``{request_id: num_new_tokens}``; the executor runs it.

`schedule` decides one step and returns it as a `SchedulerOutput` (a delta against what the
executor holds: new requests, cached requests' new blocks, the batch, finished ids); it does no
tensor work and calls no executor. `update_from_output` applies that step's sampled tokens. The
`EngineCore` calls them in turn, with the next step scheduled before the previous one's tokens
arrive: a step that will sample counts a *placeholder* token (``num_output_placeholders``), so a
decode can be scheduled again at once, and a request whose last token is already on the way
is not scheduled further. A request that stops at a token sampled steps ahead wastes those extra
steps (one with two steps in flight); their tokens are dropped here and never reported.

No prefill/decode phases (vLLM v1 style): a request is only ``num_computed_tokens`` behind its
``num_tokens``; running requests are served first, then waiting ones FCFS, all under one token
budget, so a step freely mixes decodes with prefill chunks. When blocks run out, the most
recently admitted running request is preempted by recompute (under the priority policy, the
lowest priority, latest arrival: `scheduler.request_queue`; a waiting request of a strictly higher
priority that finds no seat or no blocks preempts it too). A preempted request is not
admitted again while a step it was in is still in flight (possible with three or more in flight):
that step's output belongs to its old blocks.

Prefix caching (``SchedulerConfig.enable_prefix_caching``, on by default): a request being
admitted starts from the longest run of its leading full blocks found in the cache (shared by
reference count, never the block holding its last token), so it computes only the rest; after
each successful step (when its output arrives) the blocks its computed tokens filled are registered. A preempted or
aborted request's blocks stay cached until they are needed, so recompute after preemption is
mostly a cache hit. Counters, in tokens, over the admissions that look the cache up, readmissions
after a preemption not included (as vLLM's): ``prefix_cache_queries`` and ``prefix_cache_hits``.

Siblings (the ``n`` samples of one prompt, ``Request.group_id``) share the prompt's KV through
the prefix cache: a waiting sibling is *held* (passed over, FCFS otherwise kept) while another
sibling runs whose prompt blocks are not all registered yet; once they are (the step that
computed them answered) it is admitted and hits them, so the prompt is computed once, whatever
the chunking. Siblings admitted side by side would each compute it (blocks are registered only
after their step succeeds, never while being written), and registering blocks at allocation
would let a sibling read K/V not yet written. A request with ``prompt_logprobs`` takes no cache
hit until it has them all (a cached token has no logits), as in vLLM.

Faults: `reset_executor` moves every request to a new executor (all running ones preempted and
recomputed there, so no token is lost or changed). After a step that failed, `isolate` runs the
step's requests one at a time until each has passed a step alone; the one that fails alone is
the culprit and is failed by the caller (``abort(id, "error")``), while the others go on.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from common.config import ExecutorInfo, SchedulerConfig
from common.protocol import ExecutorOutput, SchedulerOutput
from scheduler.displacement import plan_room
from scheduler.kv_groups import KVCacheManager
from scheduler.request import Request, RequestStatus, StepOutput
from scheduler.request_queue import WaitingQueue, pick_victim
from scheduler.step_bytes import check_fits, new_request_bytes, prompt_logprob_bytes, sampling_bytes

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledStep:
    """A step whose output has not arrived: per request ``(request, start, num_tokens, samples)``."""

    step: int
    rows: list[tuple[Request, int, int, bool]] = field(default_factory=list)


class Scheduler:
    """Owns the waiting/running queues and the cache manager; decides steps, applies their outputs.

    Invariant: ``executor_blocks`` names exactly the requests the executor holds (how many of
    their block ids it has; -1 after a preemption: the next step resends the whole table).
    ``executor_skipped``: how many leading null blocks (sliding window) the executor's copy of a
    table has; when the cache manager nulls more, the whole table is resent.
    """

    def __init__(self, config: SchedulerConfig, cache_manager: KVCacheManager, info: ExecutorInfo) -> None:
        self.config = config
        self.cache = cache_manager
        self.info = info
        self.num_kv_groups = max(1, len(info.kv_group_windows))  # entries per block of a table
        self.max_model_len = info.max_model_len
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}  # live siblings by ``group_id``
        self.num_preemptions = 0
        self.num_steps = 0
        self.prefix_cache_queries = 0  # tokens of requests looked up in the cache (see the module's docstring)
        self.prefix_cache_hits = 0  # of which found in the prefix cache
        # Requests of a failed step, still to pass one step alone (in order); see `isolate`.
        self.suspects: list[str] = []
        self.executor_blocks: dict[str, int] = {}
        self.executor_skipped: dict[str, int] = {}
        self.finished_for_executor: list[str] = []  # sent with the next step
        self.pending: deque[ScheduledStep] = deque()  # scheduled, output not yet applied (oldest first)
        self.step_counter = 0
        self.max_step_bytes = config.max_step_bytes if config.max_step_bytes is not None else sys.maxsize
        assert cache_manager.block_size == info.block_size

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
        if request.priority and not self.waiting.by_priority:
            raise ValueError(f"priority {request.priority} needs the priority scheduling policy (this engine's is fcfs)")
        request.sampling_bytes = sampling_bytes(request)
        check_fits(request, self.cache.block_size, self.max_model_len, self.max_step_bytes, self.num_kv_groups)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.group_id is not None:
            self.groups.setdefault(request.group_id, []).append(request)

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
        if request.request_id in self.suspects:  # a later request may reuse its id
            self.suspects.remove(request.request_id)
        siblings = self.groups.get(request.group_id) if request.group_id is not None else None
        if siblings is not None:
            siblings.remove(request)
            if not siblings:
                del self.groups[request.group_id]  # type: ignore[arg-type]
        self.executor_skipped.pop(request.request_id, None)
        if self.executor_blocks.pop(request.request_id, None) is not None:
            self.finished_for_executor.append(request.request_id)

    def _preempt(self, request: Request, counted: bool = True) -> None:
        """Free ``request``'s blocks and requeue it first. A token a step in flight samples for it
        still arrives and is kept: that step ran with its blocks intact (the executor runs steps
        in order, so whoever gets the blocks next writes them only after)."""
        self.cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        if request.request_id in self.executor_blocks:
            self.executor_blocks[request.request_id] = -1  # it keeps its tokens; the table is resent
        request.num_preemptions += 1
        if counted:
            self.num_preemptions += 1
        self.waiting.requeue(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    # -- one engine step --------------------------------------------------------------------
    def decide(self) -> dict[str, int]:
        """Pick this step's ``{request_id: num_new_tokens}`` and allocate their blocks."""
        self.suspects = [r for r in self.suspects if r in self.requests]
        if self.suspects:
            return self._decide_alone(self.requests[self.suspects[0]])
        budget, wire = self.config.max_num_batched_tokens, self.max_step_bytes  # tokens, bytes (`step_bytes`)
        scheduled: dict[str, int] = {}
        wired: dict[str, int] = {}  # bytes of prompt logprobs each scheduled request takes
        preempted = False
        # (priority) A victim scheduled earlier in this step gives its budget back: the requests
        # passed over for want of it are looked at again, from the start, skipping the scheduled.
        rescan = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if rescan and request.request_id in scheduled:
                i += 1
                continue
            n = self._num_new_tokens(request, budget)
            per = 0
            if request.needs_prompt_logprobs:
                per = prompt_logprob_bytes(request)
                n = min(n, wire // per)
            if n == 0:
                i += 1
                continue
            undone = False
            while not self._grow(request, n):
                victim = pick_victim(self.running, self.waiting.by_priority)  # fcfs: the last
                at = next(k for k in range(len(self.running) - 1, -1, -1) if self.running[k] is victim)
                del self.running[at]
                if at < i:
                    i -= 1
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    wire += wired.pop(victim.request_id, 0)
                    undone = rescan = True
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:  # it was the victim: the next is at ``i``
                i = 0 if undone else i
                continue
            scheduled[request.request_id] = n
            budget -= n
            if per:
                wire -= n * per
                wired[request.request_id] = n * per
            i = 0 if undone else i + 1
        # Admitting while preempting would only thrash: the freed blocks go to running requests.
        w = 0
        while not preempted and w < len(self.waiting) and budget > 0:
            request = self.waiting[w]
            # A preempted request waits for the steps it is still in (three or more in flight): an
            # output applied after its readmission would register blocks of its old table as its new
            # table's (stale K/V in the prefix cache), or add a token twice.
            if (request.num_preemptions and self._in_flight(request)) or self._held(request):
                w += 1
                continue
            by_priority = self.waiting.by_priority
            if len(self.running) >= self.config.max_num_seqs and not by_priority:
                break
            cost = new_request_bytes(request, self.cache.block_size, self.num_kv_groups)
            per = prompt_logprob_bytes(request) if request.needs_prompt_logprobs else 0
            if cost + per > wire and wire < self.max_step_bytes:  # the step is full: it goes next (FCFS)
                break
            chunk = min(budget, max(1, (wire - cost) // per)) if per else budget
            hit_blocks, hit_tokens = hit = self._lookup(request)
            num_tokens = hit_tokens + min(request.num_tokens - hit_tokens, chunk)
            # (priority) Room from running requests of lower priority (`scheduler.displacement`).
            victims = plan_room(
                request, self.running if by_priority else (), self.config.max_num_seqs, self.cache, num_tokens, hit_blocks
            )
            if victims is None:
                break
            for victim in victims:
                self._stop_running(victim)
                self._preempt(victim)
                budget, wire = budget + scheduled.pop(victim.request_id, 0), wire + wired.pop(victim.request_id, 0)
            admitted = self._admit_blocks(request, chunk, hit)
            assert admitted is not None, "the room was planned"
            assert self.waiting[w] is request, "a displaced request queues after the one it made room for"
            del self.waiting[w]
            self._start_running(request)
            scheduled[request.request_id] = admitted
            budget, wire = budget - admitted, wire - cost - admitted * per
        return scheduled

    def _grow(self, request: Request, n: int) -> bool:
        """Blocks for a running request's next ``n`` tokens (those behind its window freed first)."""
        return self.cache.allocate_slots(request.request_id, request.num_computed_tokens + n, (), request.num_computed_tokens)

    def _in_flight(self, request: Request) -> bool:
        """Whether a step whose output has not arrived holds ``request``."""
        return any(row[0] is request for record in self.pending for row in record.rows)

    def _held(self, request: Request) -> bool:
        """Whether a waiting sibling should wait for a running sibling's prompt blocks to be
        cached (see the module doc); never without prefix caching or a full block to share."""
        if request.group_id is None or not self.config.enable_prefix_caching:
            return False
        shared = (len(request.prompt_token_ids) - 1) // self.cache.block_size  # what a hit can cover
        if shared == 0:
            return False
        cached = self.cache.num_cached_blocks
        return any(
            s is not request and s.status is RequestStatus.RUNNING and cached.get(s.request_id, 0) < shared
            for s in self.groups[request.group_id]
        )

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens a running request can compute now (placeholders included); 0 if its last token
        (by ``max_tokens`` or ``max_model_len``) is already being sampled."""
        ph = request.num_output_placeholders
        if ph and (
            request.num_output_tokens + ph >= request.sampling_params.max_tokens or request.num_tokens + ph >= self.max_model_len
        ):
            return 0
        n = min(request.num_tokens + ph - request.num_computed_tokens, budget)
        assert n >= 1, "running request with nothing to compute"
        return n

    def _lookup(self, request: Request) -> tuple[list[int], int]:
        """A waiting request's prefix-cache hit (blocks, tokens); none without prefix caching, or
        with prompt logprobs (a cached token has no logits)."""
        return self.cache.get_computed_blocks(request) if self._looks_up(request) else ([], 0)

    def _looks_up(self, request: Request) -> bool:
        return self.config.enable_prefix_caching and not request.needs_prompt_logprobs

    def _admit_blocks(self, request: Request, budget: int, hit: tuple[list[int], int] | None = None) -> int | None:
        """Allocate a waiting request's first chunk, after its prefix-cache hit (``hit``, if looked
        up already); its size, or None.

        On success ``num_computed_tokens`` is the hit length (0 without prefix caching)."""
        assert request.num_computed_tokens == 0, "a waiting request has nothing computed"
        assert request.num_output_placeholders == 0, "a preempted request's token arrives before its next admission"
        hit_blocks, hit_tokens = self._lookup(request) if hit is None else hit
        n = min(request.num_tokens - hit_tokens, budget)
        if not self.cache.allocate_slots(request.request_id, hit_tokens + n, hit_blocks):
            return None
        request.num_computed_tokens = hit_tokens
        if self._looks_up(request) and not request.num_preemptions:  # as vLLM: a lookup, not a readmission after preemption
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit_tokens
        return n

    def _stop_running(self, request: Request) -> None:
        """Take ``request`` out of the running ones (the last, most often: no search)."""
        if self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)

    def _start_running(self, request: Request) -> None:
        """A waiting request (out of its queue) joins the running ones; the first time ends its queue time."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()

    def schedule(self) -> SchedulerOutput:
        """Decide one step and describe it for the executor (no tensors, no I/O).

        Scheduled requests advance at once (``num_computed_tokens``); one that will sample
        counts a placeholder until `update_from_output` brings its token."""
        scheduled = self.decide()
        if not scheduled:
            return SchedulerOutput(step=self.step_counter)  # nothing to run (finished ids wait for a step)
        self.step_counter += 1
        output = SchedulerOutput(step=self.step_counter)
        output.finished_req_ids, self.finished_for_executor = self.finished_for_executor, []
        record = ScheduledStep(output.step)
        for request_id, n in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            table = self.cache.get_block_table(request_id)
            known = self.executor_blocks.get(request_id)
            skipped = self.cache.num_skipped(request_id)
            if known is not None and skipped != self.executor_skipped.get(request_id, 0):
                known = -1  # blocks left its window: its copy must stop naming them
            self.executor_skipped[request_id] = skipped
            if known is None:
                assert request.num_output_placeholders == 0, "a new request has no step in flight"
                output.add_new(
                    request_id,
                    request.sampling_params,
                    len(request.prompt_token_ids),
                    request.tokens_between(0, request.num_tokens),
                    list(table),
                )
            elif known < 0:
                output.add_cached(request_id, True, list(table))
            elif len(table) > known:
                output.add_cached(request_id, False, table[known:])
            self.executor_blocks[request_id] = len(table)
            request.num_computed_tokens = start + n
            samples = request.num_computed_tokens == request.num_tokens + request.num_output_placeholders
            output.add_scheduled(request_id, n, start, samples)
            if samples:
                request.num_output_placeholders += 1
            record.rows.append((request, start, n, samples))
        self.pending.append(record)
        return output

    def update_from_output(self, output: SchedulerOutput, result: ExecutorOutput) -> list[StepOutput]:
        """Apply step ``output``'s sampled tokens (its steps' outputs arrive in order): append them,
        check stop conditions, register the blocks it filled in the prefix cache."""
        record = self.pending.popleft()
        assert record.step == output.step, f"output of step {output.step} while step {record.step} was due"
        if len(result.token_ids) != len(record.rows):
            raise ValueError(f"{len(result.token_ids)} results for a step of {len(record.rows)} requests")
        self.num_steps += 1
        if self.suspects and len(record.rows) == 1 and record.rows[0][0].request_id == self.suspects[0]:
            self.suspects.pop(0)  # it passed a step alone
        outputs: list[StepOutput] = []
        finished: list[Request] = []
        caching = self.config.enable_prefix_caching
        block_size = self.cache.block_size
        for i, (request, start, n, samples) in enumerate(record.rows):
            if self.requests.get(request.request_id) is not request:
                continue  # finished (its extra token is dropped) or aborted while the step ran
            if caching and request.status is RequestStatus.RUNNING and start % block_size + n >= block_size:
                self.cache.cache_full_blocks(request, start + n)  # a block filled up and the step succeeded
            computed = result.prompt_logprobs[i] if result.prompt_logprobs else None
            have = len(request.prompt_logprobs)
            if computed is not None and start <= have < start + len(computed):
                # Only what is new: a request recomputed after a preemption chunks its prompt anew.
                request.prompt_logprobs.extend(computed[have - start :])
            if not samples:
                continue
            request.num_output_placeholders -= 1
            token = result.token_ids[i]  # the executor samples exactly the rows the step said
            if token < 0:  # its "nothing sampled": this executor and this step disagree
                raise ValueError(f"request {request.request_id} was due a token in step {record.step}")
            logprobs = result.logprobs[i] if result.logprobs else None
            request.output_token_ids.append(token)
            request.output_logprobs.append(logprobs)
            reason = request.stop_reason_for(token, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                finished.append(request)
                request.finish_reason = reason
            prompt_logprobs = None
            if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                request.prompt_logprobs_sent = True
                prompt_logprobs = [None, *request.prompt_logprobs]  # the first prompt token has none
            outputs.append(
                StepOutput(
                    request.request_id,
                    [token],
                    [logprobs],
                    reason is not None,
                    reason,
                    request.num_output_tokens,
                    request.queue_time_s,
                    stop_reason=request.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        for request in finished:
            (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
            self._finish(request, request.finish_reason or "stop")
        return outputs

    # -- executor faults (see the module's docstring, "Faults") -----------------------------
    def reset_executor(self, info: ExecutorInfo, cache_manager: KVCacheManager) -> dict[str, str]:
        """Carry on with another executor and KV pool: running requests are preempted (recompute).
        Those it cannot serve (a shorter ``max_model_len``, a smaller vocabulary) are failed, and
        returned with why (kept, one would preempt itself forever or fail its steps)."""
        self.executor_lost()
        assert cache_manager.block_size == info.block_size
        for request in self.requests.values():
            request.block_hashes.clear()  # they depend on the block size, which may change
        self.info = info
        self.cache = cache_manager
        self.num_kv_groups = max(1, len(info.kv_group_windows))
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
        self.executor_skipped.clear()
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
                if not self._grow(request, n):
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
