"""`StreamExecutor`: the scheduler's executor when the model runs in another process.

It implements the executor interface (``.info`` + ``.execute_model(batch)``) so the very same
`Scheduler` drives it, but sends each `Batch` as a `StepDelta`: only what the executor does not
already hold. Both sides keep, per request, a token store and a block table; each step edits them
with ``store[start:] = values``. A mirror of the executor's stores lives here, so a decode step
carries one new token and (every ``block_size`` steps) one new block id per sequence, and a
prompt's tokens travel once. Preemption (a different block table) and any other divergence are
just larger edits, so the executor's rebuilt `Batch` always equals the scheduler's.

`execute_model` runs inline on the engine's thread and blocks on Redis: no event loop, no thread
hand-off in the hot path (each one is a wake-up, which costs most on a busy CPU).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from common.batch import Batch, ExecutorOutput
from common.config import ExecutorInfo
from common.protocol import (
    ENGINE_STREAMS_TTL_MS,
    STEPS_MAXLEN,
    StepDelta,
    StepResult,
    apply_edit,
    sampling_to_dict,
    unpack_logprobs,
)
from common.transport import Outgoing, SyncTransport

logger = logging.getLogger(__name__)

class ExecutorLost(RuntimeError):
    """The executor died or stopped answering (or Redis restarted under the step): its KV state
    is gone, so the scheduler preempts every running request and rebinds an executor."""


class StepFailed(RuntimeError):
    """The executor answered a step with an error (it has dropped its state for every request)."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(slots=True)
class _Mirror:
    """The executor's view of one request, as of the last step sent."""

    tokens: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)


class DeltaEncoder:
    """Turns consecutive full `Batch`es into `StepDelta`s (pure: no I/O, unit-testable)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.mirrors: dict[str, _Mirror] = {}
        self._released: list[str] = []

    def release(self, request_ids: list[str]) -> None:
        """Forget these requests here and, with the next step, on the executor."""
        for request_id in request_ids:
            if self.mirrors.pop(request_id, None) is not None:
                self._released.append(request_id)

    def encode(self, batch: Batch, epoch: int, step: int) -> StepDelta:
        delta = StepDelta(epoch=epoch, step=step, release=self._released)
        self._released = []
        bs = self.block_size
        offset = 0
        for i, request_id in enumerate(batch.request_ids):
            q, s = batch.query_lens[i], batch.seq_lens[i]
            a = s - q
            window = batch.input_ids[offset : offset + q]
            slots = batch.slot_mapping[offset : offset + q]
            offset += q
            mirror = self.mirrors.get(request_id)
            if mirror is None:
                mirror = self.mirrors[request_id] = _Mirror()
                delta.new_ids.append(request_id)
                delta.new_sampling.append(sampling_to_dict(batch.sampling_params[i]))
            # Tokens: send the part of this step's window the executor does not hold yet.
            tokens = mirror.tokens
            n = len(tokens)
            if a >= n:
                start, values = a, window
            else:
                overlap = min(s, n) - a
                j = 0
                while j < overlap and tokens[a + j] == window[j]:
                    j += 1
                start, values = (a + j, window[j:]) if j < overlap else (n, window[overlap:])
            apply_edit(tokens, start, values)
            delta.token_starts.append(start)
            delta.num_new_tokens.append(len(values))
            delta.new_tokens.extend(values)
            # Block table: normally it only grows; anything else resends from the first change.
            table, known = batch.block_tables[i], mirror.table
            if len(table) >= len(known) and table[: len(known)] == known:
                bstart = len(known)
            else:
                bstart = next((k for k, (x, y) in enumerate(zip(table, known)) if x != y), min(len(table), len(known)))
            new_blocks = table[bstart:]
            apply_edit(known, bstart, new_blocks)
            delta.block_starts.append(bstart)
            delta.num_new_blocks.append(len(new_blocks))
            delta.new_blocks.extend(new_blocks)
            # Slots follow from the table; send them only where the scheduler chose otherwise.
            if slots != [table[p // bs] * bs + p % bs for p in range(a, s)]:
                delta.slot_seqs.append(i)
                delta.slots.extend(slots)
            delta.request_ids.append(request_id)
            delta.query_lens.append(q)
            delta.seq_lens.append(s)
            delta.output_lens.append(batch.output_lens[i])
            delta.sample.append(batch.sample[i])
        return delta


class StreamExecutor:
    """Executor interface over Redis streams for one bound executor and epoch.

    Runs on the engine's own thread with blocking calls: a step is one pipelined round trip
    (XADD the delta, then a blocking XREAD of the results stream). The service queues the previous
    step's outputs in `outbox`, and they ride in the same round trip; `flush` sends them when no
    step follows.
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
        self.encoder = DeltaEncoder(info.block_size)
        self.step = 0
        self.last_forward_s = 0.0
        self.outbox: list[Outgoing] = []  # messages that ride with the next step
        self._steps_stream = transport.names.steps(scheduler_id)
        self._results_stream = transport.names.results(scheduler_id)

    def release(self, request_ids: list[str]) -> None:
        self.encoder.release(request_ids)

    def forget_all(self) -> None:
        """The executor dropped every request (after a failed step): resend everything from now on."""
        self.encoder = DeltaEncoder(self.info.block_size)

    def flush(self) -> None:
        """Send the queued messages now (no step is coming to carry them)."""
        if self.outbox:
            sends, self.outbox = self.outbox, []
            self.transport.exchange(sends)

    def execute_model(self, batch: Batch) -> ExecutorOutput:
        """Send one step (with the queued outputs) and wait for its result."""
        self.step += 1
        delta = self.encoder.encode(batch, self.epoch, self.step)
        sends, self.outbox = self.outbox, []
        sends.append(Outgoing(self._steps_stream, self.transport.encode(delta), STEPS_MAXLEN, ENGINE_STREAMS_TTL_MS))
        result = self._round_trip(sends, delta.step)
        if result.error is not None:
            raise StepFailed(f"executor {self.executor_id} failed step {delta.step}: {result.error}", list(batch.request_ids))
        if len(result.token_ids) != batch.num_seqs:
            raise ExecutorLost(f"executor returned {len(result.token_ids)} tokens for {batch.num_seqs} sequences")
        self.last_forward_s = result.forward_s
        if not result.lp_counts:
            return ExecutorOutput(token_ids=result.token_ids, logprobs=[])
        logprobs = unpack_logprobs(result.lp_counts, result.lp_token_ids, result.lp_values)
        return ExecutorOutput(token_ids=result.token_ids, logprobs=logprobs)

    def _round_trip(self, sends: list[Outgoing], step: int) -> StepResult:
        cursors: dict[str, bytes | str] = {self._results_stream: self.results_cursor}
        block_ms = int(self.liveness_check_s * 1000)
        start = last_check = time.monotonic()
        try:
            # Results already read are trimmed in the same round trip: the stream stays a few entries long.
            got = self.transport.exchange(sends, cursors, count=64, block_ms=block_ms,
                                          trim={self._results_stream: self.results_cursor})
            while True:
                for _, _, msg in got:
                    if isinstance(msg, StepResult) and msg.epoch == self.epoch and msg.step == step:
                        return msg
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
                got = self.transport.read(cursors, count=64, block_ms=block_ms)
        finally:
            self.results_cursor = cursors[self._results_stream]  # type: ignore[assignment]
