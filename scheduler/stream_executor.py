"""`StreamExecutor`: the scheduler's executor when the model runs in another process.

It is a `StepExecutor` (``.info``, ``.submit(output)``, ``.collect()``), so the very same
`EngineCore` drives it: each `SchedulerOutput` is sent as it is (the executor keeps the request
state it describes), and results come back in step order. With one step scheduled ahead, step N+1
is sent in the same round trip that waits for step N's result, so it is already in the executor's
stream when N ends.

Everything runs inline on the engine's thread and blocks on Redis: no event loop, no thread
hand-off in the hot path (each one is a wake-up, which costs most on a busy CPU).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from common.codec import unpack_logprobs, unpack_prompt_logprobs
from common.config import ExecutorInfo
from common.protocol import ENGINE_STREAMS_TTL_MS, STEPS_MAXLEN, BindExecutor, ExecutorOutput, SchedulerOutput, StepResult
from common.transport import Outgoing, SyncTransport
from common.watchdog import Watchdog

logger = logging.getLogger(__name__)


class ExecutorLost(RuntimeError):
    """The executor died or stopped answering (or Redis restarted under the step): its KV state
    is gone, so the scheduler preempts every running request and rebinds an executor."""


class StepFailed(RuntimeError):
    """The executor answered a step with an error: it has dropped its state for every request and
    ignores the rest of the epoch, so the scheduler rebinds it (`StreamExecutor.rebind`)."""


class StreamExecutor:
    """`StepExecutor` over Redis streams for one bound executor and epoch.

    `submit` queues a step; `collect` sends what is queued (steps, and the previous step's outputs
    for the gateways in `outbox`) and waits for the oldest step's result, all in one pipelined
    round trip (XADD, then a blocking XREAD of the results stream). `flush` sends the outbox when
    no step follows.
    """

    def __init__(
        self,
        info: ExecutorInfo,
        transport: SyncTransport,
        *,
        scheduler_id: str,
        executor_id: str,
        epoch: int,
        results_cursor: bytes,
        result_timeout_s: float = 60.0,
        liveness_check_s: float = 0.5,
        redis_restarted: threading.Event | None = None,
        claim_lost: threading.Event | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.info = info
        self.transport = transport
        self.scheduler_id = scheduler_id
        self.executor_id = executor_id
        self.epoch = epoch
        self.results_cursor = results_cursor
        self.result_timeout_s = result_timeout_s
        self.liveness_check_s = liveness_check_s
        self.redis_restarted = redis_restarted or threading.Event()
        self.claim_lost = claim_lost or threading.Event()  # auto pairing: another scheduler took it
        self.watchdog = watchdog  # ticked while waiting for a result: a wait is no stall
        self.last_forward_s = 0.0
        self.outbox: list[Outgoing] = []  # messages that ride with the next round trip
        self.in_flight: deque[tuple[int, int]] = deque()  # (step, number of requests), oldest first
        self.early: dict[int, StepResult] = {}  # results read before their turn
        self._steps_stream = transport.names.steps(scheduler_id)
        self._results_stream = transport.names.results(scheduler_id)

    def rebind(self, epoch: int) -> None:
        """Start a new epoch with the same executor (it drops every request; see `StepFailed`)."""
        self.epoch = epoch
        self.in_flight.clear()
        self.early.clear()
        self.outbox.append(self._outgoing(BindExecutor(self.executor_id, self.scheduler_id, epoch)))

    def flush(self) -> None:
        """Send the queued messages now (no step is coming to carry them)."""
        if self.outbox:
            sends, self.outbox = self.outbox, []
            self.transport.exchange(sends)

    def flush_outputs(self) -> None:
        """Send the queued outputs for the gateways, not the queued steps: the engine that planned
        them failed (its requests' ends may be among the outputs, and nothing else would send them)."""
        self.outbox = [o for o in self.outbox if o.stream != self._steps_stream]
        self.flush()

    def submit(self, output: SchedulerOutput) -> None:
        """Queue one step; it leaves with the next `collect` (or `flush`)."""
        output.epoch = self.epoch
        self.outbox.append(self._outgoing(output))
        self.in_flight.append((output.step, output.num_seqs))

    def collect(self) -> ExecutorOutput:
        """Send what is queued and return the oldest step's result (raises `StepFailed`/`ExecutorLost`)."""
        step, num_seqs = self.in_flight.popleft()
        sends, self.outbox = self.outbox, []
        result = self.early.pop(step, None)
        if result is None:
            result = self._round_trip(sends, step)
        elif sends:  # its result came with the previous one's; what is queued (the next step) goes now
            self.transport.exchange(sends)
        if result.error is not None:
            raise StepFailed(f"executor {self.executor_id} failed step {step}: {result.error}")
        if len(result.token_ids) != num_seqs:
            raise ExecutorLost(f"executor returned {len(result.token_ids)} tokens for {num_seqs} requests")
        self.last_forward_s = result.forward_s
        logprobs = unpack_logprobs(result.lp_counts, result.lp_token_ids, result.lp_values) if result.lp_counts else []
        prompt_logprobs = (
            unpack_prompt_logprobs(
                num_seqs, result.plp_num, result.plp_counts, result.plp_token_ids, result.plp_values, result.plp_ranks
            )
            if result.plp_num
            else []
        )
        return ExecutorOutput(result.token_ids, logprobs, prompt_logprobs)

    def _outgoing(self, msg: SchedulerOutput | BindExecutor) -> Outgoing:
        return Outgoing(self._steps_stream, self.transport.encode(msg), STEPS_MAXLEN, ENGINE_STREAMS_TTL_MS)

    def _round_trip(self, sends: list[Outgoing], step: int) -> StepResult:
        cursors: dict[str, bytes | str] = {self._results_stream: self.results_cursor}
        block_ms = int(self.liveness_check_s * 1000)
        start = last_check = time.monotonic()
        try:
            # Results already read are trimmed in the same round trip: the stream stays a few entries long.
            got = self.transport.exchange(
                sends, cursors, count=64, block_ms=block_ms, trim={self._results_stream: self.results_cursor}
            )
            while True:
                if self.watchdog is not None:
                    self.watchdog.tick()
                found: StepResult | None = None
                for _, _, msg in got:
                    if isinstance(msg, StepResult) and msg.epoch == self.epoch:
                        if msg.step == step:
                            found = msg
                        elif msg.step > step:
                            self.early[msg.step] = msg
                if found is not None:
                    return found
                now = time.monotonic()
                if now - start > self.result_timeout_s:
                    raise ExecutorLost(
                        f"executor {self.executor_id} sent no result for step {step} within {self.result_timeout_s:.0f}s"
                    )
                if self.redis_restarted.is_set():
                    # The step or its result may have been lost with Redis: start over with a new epoch.
                    self.redis_restarted.clear()
                    raise ExecutorLost(f"Redis restarted during step {step}")
                if now - last_check >= self.liveness_check_s:
                    last_check = now
                    if not self.transport.alive("executor", self.executor_id):
                        raise ExecutorLost(f"executor {self.executor_id} stopped (its heartbeat expired)")
                    if self.claim_lost.is_set():
                        raise ExecutorLost(f"executor {self.executor_id} was claimed by another scheduler")
                got = self.transport.read(cursors, count=64, block_ms=block_ms)
        finally:
            self.results_cursor = cursors[self._results_stream]  # type: ignore[assignment]
