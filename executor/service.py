"""`conveyor executor`: loads the model, allocates the KV cache, and runs steps from its scheduler.

Protocol with the scheduler (see `common.protocol`): announce with `ExecutorHello` on the results
stream (again every few seconds while idle, so a restarted scheduler finds it), accept the
`BindExecutor` that names this executor, then execute every `SchedulerOutput` of that epoch and
answer with a `StepResult`. Steps of any other epoch are ignored: they refer to KV state of a
previous binding. A step that fails drops every request's state and ends the epoch here (later
steps of it, already sent one ahead, are ignored): the scheduler rebinds with a new epoch and
resends every request. The step stream has exactly one reader (this process), so no consumer group. The loop
is one thread (the forward pass inline; the read of the next step sent before the current one runs,
results not waited for: `executor.overlap`); heartbeats run on their own thread.

With the next step already read, it is launched before the current one is collected
(`ModelExecutor.launch`): the host prepares step N+1 while the device runs step N, and step N's
result leaves right after. A step with nothing queued behind it is collected at once. Where a
launch runs the step itself (CPU: `ModelExecutor.launch_returns_early` is false), the step before
is collected and sent first, or every result would leave one step late.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from common.codec import pack_logprobs, pack_prompt_logprobs
from common.config import CPU_DECODE_KERNEL_MODES, CacheConfig, ModelConfig, ParallelConfig, ServiceDefaults
from common.heartbeat import Heartbeat
from common.protocol import ENGINE_STREAMS_TTL_MS, RESULTS_MAXLEN, BindExecutor, ExecutorHello, Names, SchedulerOutput, StepResult
from common.redis_errors import REDIS_FAILURES, TRANSIENT_ERRORS, Backoff
from common.service_cli import (
    AUTO,
    add_engine_id,
    env_flag,
    freeze_startup_heap,
    record_process_id,
    run_service,
    service_parser,
    setup_logging,
    stop_on_sigterm,
)
from common.transport import Outgoing, SyncTransport
from common.watchdog import Watchdog
from executor.overlap import PendingRead, WriteBehind
from executor.pairing import ANNOUNCE_INTERVAL_S, ExecutorOffer

logger = logging.getLogger("conveyor.executor")

HELLO_INTERVAL_S = 3.0
CLAIM_CHECK_S = 0.5  # auto pairing: how often a claimed executor checks that the claim still holds


@dataclass(slots=True)
class Served:
    """Where serving one scheduler ended: the last steps entry run (or skipped), and the results
    Redis had not confirmed."""

    done: bytes | str
    unsent: list[Outgoing]


@dataclass(slots=True)
class ExecutorServiceConfig:
    redis_url: str
    model: str
    namespace: str = ServiceDefaults.namespace
    scheduler_id: str = "0"
    executor_id: str = ""
    model_config: ModelConfig | None = None
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    heartbeat_ttl_ms: int = ServiceDefaults.heartbeat_ttl_ms
    stall_timeout_s: float = ServiceDefaults.stall_timeout_s


class ExecutorService:
    """One executor process bound to one scheduler id.

    ``model_executor`` is a `ModelExecutor` (or anything with its ``info``, ``execute_model`` and
    ``reset``): it holds the requests' state between steps."""

    def __init__(self, config: ExecutorServiceConfig, model_executor: object) -> None:
        self.config = config
        self.model = model_executor
        self.info = model_executor.info  # type: ignore[attr-defined]
        self.eid = config.executor_id or uuid.uuid4().hex[:12]
        self.names = Names(config.namespace)
        self.transport = SyncTransport(config.redis_url, self.names, owner=f"executor {self.eid}")
        self.epoch: int | None = None
        # Ticked on every turn of the step loop (its reads are bounded; a step is not): a step stuck
        # in the model, say a hung device, ends the process (`common.watchdog`).
        self.watchdog = Watchdog("the step loop", config.stall_timeout_s)
        self.stopping = threading.Event()  # `run` returns once set (and its read times out)
        self.last_step = 0  # of the current epoch
        self.in_flight: InFlight | None = None  # launched, not collected (`_handle`)

    def _hello(self) -> ExecutorHello:
        i = self.info
        return ExecutorHello(
            self.eid,
            i.model_name,
            self.config.model,
            i.num_blocks,
            i.block_size,
            i.max_model_len,
            i.vocab_size,
            list(i.eos_token_ids),
            i.sliding_window or 0,
            list(i.kv_group_windows),
        )

    def run(self) -> None:
        """Serve until interrupted: the scheduler of ``--scheduler-id``, or with ``auto`` whichever
        scheduler claims this executor (`executor.pairing`), again after each claim ends."""
        t = self.transport
        t.ping()
        ttl = self.config.heartbeat_ttl_ms
        heartbeat = Heartbeat(
            self.config.redis_url,
            self.names,
            "executor",
            self.eid,
            ServiceDefaults.heartbeat_interval_s(ttl),
            ttl,
            self.watchdog,
        ).start()
        record_process_id("executor", self.eid)
        logger.info("executor %s up (%d blocks of %d)", self.eid, self.info.num_blocks, self.info.block_size)
        pairing = ExecutorOffer(t.redis, self.names, ttl) if self.config.scheduler_id == AUTO else None
        try:
            if pairing is None:
                self._serve(self.config.scheduler_id, None)
            left: tuple[str, Served] | None = None  # the scheduler last served, and where that ended
            while pairing is not None and not self.stopping.is_set():
                scheduler_id = self._wait_for_claim(pairing)
                if scheduler_id is None:
                    break
                resume = None
                if left is not None and left[0] == scheduler_id:
                    # Claimed again by the scheduler it served: its claim had lapsed (it stalled, or
                    # was frozen, past the TTL) and it took it back. Its requests' state and epoch
                    # still hold, and it waits for the steps it sent meanwhile: go on after the last
                    # one run.
                    resume = left[1]
                    logger.info("claimed again by scheduler %s; resuming after its step entry %s", scheduler_id, resume.done)
                elif left is not None:
                    self.epoch = None
                    self.model.reset()  # type: ignore[attr-defined]
                left = (scheduler_id, self._serve(scheduler_id, pairing, resume))
                logger.info("no longer claimed by scheduler %s; offering this executor again", scheduler_id)
        finally:
            if pairing is not None:
                try:
                    t.call(pairing.withdraw, self.eid, deadline_s=2)
                except TRANSIENT_ERRORS:
                    pass  # its entry goes stale and is dropped: `ExecutorClaims.offered`
            heartbeat.stop(wait_s=2.0)  # no beat may land after the delete below
            try:  # its scheduler sees it gone now, not a TTL later (a stop, a rolling update, a crash)
                t.call(heartbeat.withdraw, deadline_s=2)
            except REDIS_FAILURES as exc:
                logger.warning("could not delete this executor's heartbeat (it expires with its TTL): %s", exc)
            t.close()

    def _wait_for_claim(self, pairing: ExecutorOffer) -> str | None:
        """Announce this executor until a scheduler claims it: that scheduler's id (None: stopping)."""
        t = self.transport
        logger.info("executor %s: waiting for a scheduler to claim it", self.eid)
        while not self.stopping.is_set():
            self.watchdog.tick()
            owner = t.call(pairing.owner, self.eid)
            if owner is not None:
                t.call(pairing.withdraw, self.eid)
                logger.info("claimed by scheduler %s", owner)
                return owner
            t.call(pairing.announce, self.eid)
            self.stopping.wait(ANNOUNCE_INTERVAL_S)
        return None

    def _serve(self, scheduler_id: str, pairing: ExecutorOffer | None, resume: Served | None = None) -> Served:
        """Execute the steps of ``scheduler_id`` (by default those sent from now on; those after
        where ``resume`` ended, its unconfirmed results sent first) until stopped, or (``pairing``)
        until its claim on this executor ends; returns where serving the same scheduler goes on.

        The read of the steps stream leaves before the step at hand runs, and a result leaves without
        waiting for Redis's answer (`executor.overlap`), so a step the scheduler sent meanwhile is
        here when the current one ends. After a Redis error both are redone with retries.
        """
        t = self.transport
        steps, results = self.names.steps(scheduler_id), self.names.results(scheduler_id)
        done = resume.done if resume is not None else t.last_id(steps)  # the last entry run (or skipped)
        cursors: dict[str, bytes | str] = {steps: done}
        trimmed = done
        hello = Outgoing(results, t.encode(self._hello()), RESULTS_MAXLEN, ENGINE_STREAMS_TTL_MS)
        sends: list[Outgoing] = [hello, *(resume.unsent if resume is not None else [])]
        queue: deque[tuple[bytes, SchedulerOutput | BindExecutor]] = deque()  # read, not yet run
        writes = WriteBehind(t)
        read: PendingRead | None = None
        outage: Backoff | None = None  # since the last read that answered, while Redis fails
        last_activity = last_claim_check = time.monotonic()
        run_id = t.run_id()
        launch_early = bool(getattr(self.model, "launch_returns_early", False))
        logger.info("executor %s: serving scheduler %s", self.eid, scheduler_id)
        try:
            while not self.stopping.is_set():
                self.watchdog.tick()
                if pairing is not None and time.monotonic() - last_claim_check > CLAIM_CHECK_S:
                    last_claim_check = time.monotonic()
                    if t.call(pairing.owner, self.eid) != scheduler_id:
                        break
                got: list[Any] | None = None  # None: nothing read this turn
                try:
                    if self.in_flight is not None and not launch_early:
                        self._flush(results, sends)  # run already: its result leaves before the next runs
                    if sends:  # steps run ride along as a trim (this process is the stream's only reader)
                        writes.send(sends, trim={steps: done} if done != trimmed else None)
                        sends, trimmed = [], done
                    if read is None:  # sent before the queued step runs, which it then overlaps
                        read = PendingRead(t, cursors, count=16, block_ms=1000, expected=(BindExecutor, SchedulerOutput))
                    elif not queue or read.ready():
                        if not read.ready():
                            writes.settle()  # about to wait: a result that did not land is redone first
                        got, read = [(entry_id, msg) for _, entry_id, msg in read.take()], None
                except TRANSIENT_ERRORS as exc:
                    t.forget_renewals()  # Redis may have restarted: the streams written next need their TTLs
                    if read is not None:
                        read.close()
                        read = None
                    # An idle executor has nothing to redo, so nothing that waits: the read is retried
                    # after a wait that grows as a call's does (`Backoff` logs each retry), until one answers.
                    outage = outage or Backoff(f"executor {self.eid}", None)
                    self.stopping.wait(outage.wait_s(exc))
                    writes.redo()  # blocks, retrying, until Redis answers
                    sends = []
                    continue
                if got is not None:
                    outage = None  # a read answered: the next outage backs off from the start
                    queue.extend(got)
                    if not got:
                        # Idle: re-announce every few seconds, so a scheduler that (re)started finds this
                        # executor, and at once when Redis restarted (the announcements were lost with it).
                        restarted = run_id != (run_id := t.run_id())
                        if restarted or time.monotonic() - last_activity > HELLO_INTERVAL_S:
                            sends.append(hello)
                            last_activity = time.monotonic()
                if queue and read is not None:  # a step runs only with the read for the next one out
                    last_activity = time.monotonic()
                    done, msg = queue.popleft()
                    self._handle(msg, results, sends)
                    if not queue:  # nothing to launch behind it: its result leaves now
                        self._flush(results, sends)
        finally:
            if read is not None:
                read.close()
            try:
                self._flush(results, sends)
                writes.send(sends)  # a last result, and the answers of the one before
                writes.settle()
            except Exception as exc:  # kept for a resume; whoever else serves the scheduler is rebound
                logger.warning("could not send the last results: %s", exc)
            unsent = list(writes.unconfirmed[0]) if writes.unconfirmed is not None else []
            writes.close()
        return Served(done, unsent)

    def _handle(self, msg: SchedulerOutput | BindExecutor, results: str, sends: list[Outgoing]) -> None:
        """Apply a binding, or run a step of the bound epoch (its result appended to ``sends``)."""
        if isinstance(msg, BindExecutor):
            self._flush(results, sends)  # the step in flight belongs to the binding before
            if msg.executor_id == self.eid and msg.epoch == self.epoch:
                return  # a copy (a retried send): a second reset would drop the state its steps built
            if msg.executor_id == self.eid:
                logger.info("bound to scheduler %s, epoch %d", msg.scheduler_id, msg.epoch)
                self.epoch = msg.epoch
            elif self.epoch is not None:
                logger.warning("scheduler bound another executor (%s); unbound", msg.executor_id)
                self.epoch = None
            self.model.reset()  # type: ignore[attr-defined]
            self.last_step = 0
        elif msg.epoch == self.epoch and msg.step > self.last_step:
            # (a step seen twice, from a retried send, is not executed twice)
            if self.last_step and msg.step != self.last_step + 1:
                # A scheduler numbers an epoch's steps one by one, so this entry is not its: run, it
                # would make every real step look old and stall the engine until a rebind.
                logger.warning("step %d skips ahead of step %d in epoch %d; ignored", msg.step, self.last_step, msg.epoch)
                return
            self.last_step = msg.step
            launched = self._launch(msg)
            self._flush(results, sends)  # the step before, collected once this one is on its way
            if msg.epoch != self.epoch:
                return  # the step before failed: this one refers to the state that dropped
            if isinstance(launched, StepResult):  # it failed
                self.epoch = None  # the rest of the epoch refers to the state just dropped
                sends.append(Outgoing(results, self.transport.encode(launched), RESULTS_MAXLEN, ENGINE_STREAMS_TTL_MS))
            else:
                self.in_flight = launched

    def _flush(self, results: str, sends: list[Outgoing]) -> None:
        """Collect the step in flight, if any (its result appended to ``sends``)."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        result = self._collect(in_flight)
        if result.error is not None:
            self.epoch = None  # the rest of the epoch refers to the state just dropped
        sends.append(Outgoing(results, self.transport.encode(result), RESULTS_MAXLEN, ENGINE_STREAMS_TTL_MS))

    def _step(self, output: SchedulerOutput) -> StepResult:
        """Run one step whole: launch, then collect."""
        launched = self._launch(output)
        return launched if isinstance(launched, StepResult) else self._collect(launched)

    def _launch(self, output: SchedulerOutput) -> InFlight | StepResult:
        """Launch one step; a failed one is its error result."""
        result = StepResult(epoch=output.epoch, step=output.step)
        launch = getattr(self.model, "launch", None)
        try:
            t0 = time.perf_counter()
            launched = launch(output) if launch is not None else self.model.execute_model(output)  # type: ignore[attr-defined]
            return InFlight(output, result, launched, launch is None, time.perf_counter() - t0)
        except Exception as exc:  # report, drop state; the scheduler isolates the step's requests
            return self._failed(output, result, exc)

    def _collect(self, in_flight: InFlight) -> StepResult:
        """The result of a launched step."""
        result, out = in_flight.result, in_flight.launched
        if not in_flight.done:
            try:
                t0 = time.perf_counter()
                out = self.model.collect(out)  # type: ignore[attr-defined]
                in_flight.seconds += time.perf_counter() - t0
            except Exception as exc:
                return self._failed(in_flight.output, result, exc)
        result.forward_s = in_flight.seconds
        result.token_ids = list(out.token_ids)
        if out.logprobs and any(lp is not None for lp in out.logprobs):
            result.lp_counts, result.lp_token_ids, result.lp_values = pack_logprobs(list(out.logprobs))
        if out.prompt_logprobs:
            packed = pack_prompt_logprobs(out.prompt_logprobs)
            result.plp_num, result.plp_counts, result.plp_token_ids, result.plp_values, result.plp_ranks = packed
        return result

    def _failed(self, output: SchedulerOutput, result: StepResult, exc: Exception) -> StepResult:
        """``result`` as the error of ``output``, every request's state dropped; `DeviceBroken` if
        the device does not work any more."""
        logger.error("step %d failed", output.step, exc_info=exc)
        try:
            self.model.check_device()  # type: ignore[attr-defined]
        except Exception as broken:
            # Reported, every request would be failed in turn as a culprit, and the engine
            # would look healthy while it answered only errors. Gone, its requests wait for
            # (or move to) an executor that works: a supervisor restarts this one.
            raise DeviceBroken(f"the device is unusable after step {output.step} failed: {broken}") from exc
        self.model.reset()  # type: ignore[attr-defined]
        result.error = f"{exc.__class__.__name__}: {exc}"
        return result


@dataclass(slots=True)
class InFlight:
    """A step launched and not collected: its result so far, the model's handle on it
    (`ModelExecutor.launch`, or the finished `ExecutorOutput` of a model that only executes whole
    steps), and the host seconds spent on it."""

    output: SchedulerOutput
    result: StepResult
    launched: Any
    done: bool
    seconds: float


class DeviceBroken(RuntimeError):
    """The executor's device fails even a trivial operation after a failed step: the process exits."""


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = service_parser(
        "conveyor executor", "Run the executor service (model + KV cache).", "local Hugging Face model directory (required)"
    )
    add_engine_id(p, "executor", "scheduler")
    p.add_argument("--executor-id", default=env("CONVEYOR_EXECUTOR_ID", ""))
    p.add_argument("--dtype", default=env("CONVEYOR_DTYPE", "auto"))
    p.add_argument("--device", default=env("CONVEYOR_DEVICE", "auto"))
    p.add_argument("--max-model-len", type=int, default=int(env("CONVEYOR_MAX_MODEL_LEN", "0")) or None)
    p.add_argument("--attention-backend", default=env("CONVEYOR_ATTENTION_BACKEND", "auto"))
    p.add_argument("--block-size", type=int, default=int(env("CONVEYOR_BLOCK_SIZE", "16")))
    p.add_argument("--num-blocks", type=int, default=int(env("CONVEYOR_NUM_BLOCKS", "0")) or None)
    p.add_argument(
        "--kv-cache-memory", type=int, default=int(env("CONVEYOR_KV_CACHE_MEMORY", "0")) or None, help="bytes of KV cache on CPU"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=float(env("CONVEYOR_GPU_MEMORY_UTILIZATION", "0.9")))
    p.add_argument("--seed", type=int, default=int(env("CONVEYOR_SEED", "0")))
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=int(env("CONVEYOR_TENSOR_PARALLEL_SIZE", "1")),
        help="ranks (GPUs, or CPU processes) this executor shards the model over, on this machine",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=env_flag("CONVEYOR_ENFORCE_EAGER"),
        help="no CUDA graphs: run every decode step eagerly",
    )
    p.add_argument(
        "--cpu-decode-kernel",
        choices=CPU_DECODE_KERNEL_MODES,
        default=env("CONVEYOR_CPU_DECODE_KERNEL", "auto"),
        help="auto: decode steps of up to 8 rows run in C on CPU (fp32 dense models; built at load); off: torch",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU intra-op threads (default: CONVEYOR_NUM_THREADS, OMP_NUM_THREADS, else the usable CPUs)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from executor.threads import set_openmp_env_defaults

    set_openmp_env_defaults()  # before anything imports torch: libgomp reads it once, when loaded
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("--model (or CONVEYOR_MODEL) is required")
    model_config = ModelConfig(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        seed=args.seed,
        num_threads=args.num_threads,
        enforce_eager=args.enforce_eager,
        cpu_decode_kernel=args.cpu_decode_kernel,
    )
    parallel_config = ParallelConfig(args.tensor_parallel_size)
    cache_config = CacheConfig(
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_blocks,
    )
    try:  # bad options are a usage error, reported before anything is loaded
        model_config.validate()
        cache_config.validate()
        parallel_config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level, log_format=args.log_format)
    stop_on_sigterm()
    from executor.tp_executor import build_executor  # heavy (torch): only here

    logger.info("loading %s", args.model)
    # A dead tensor-parallel rank ends this process: the scheduler sees one executor die.
    model_executor = build_executor(model_config, parallel_config, cache_config, fatal_peer_death=True)
    freeze_startup_heap()
    config = ExecutorServiceConfig(
        args.redis_url,
        args.model,
        args.namespace,
        args.scheduler_id,
        args.executor_id,
        model_config,
        cache_config,
        args.heartbeat_ttl_ms,
        args.stall_timeout,
    )
    try:
        return run_service(ExecutorService(config, model_executor).run, logger)
    finally:
        model_executor.shutdown()  # a tensor-parallel executor stops its other ranks
