"""`conveyor scheduler`: the engine loop as a service between the gateways and one executor.

It binds an executor (the newest live `ExecutorHello`), builds the very `Scheduler` and
`CacheManager` the offline `LLM` uses with a `StreamExecutor`, and then loops: take new requests
and aborts (read by background threads), run one step inline, queue one `StepOutputs` per
gateway (sent in the next step's round trip, or at once if no step follows). Failures are contained: a malformed message is
dead-lettered; a gateway whose heartbeat expires has its requests aborted; a lost executor fails
every in-flight request with an error (never a hang) and the service waits for the next one.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

from common.config import ExecutorInfo, SchedulerConfig
from common.protocol import (
    ENTRY_FIELD,
    MAX_MESSAGE_BYTES,
    OUTPUTS_MAXLEN,
    STEPS_MAXLEN,
    AbortRequests,
    BindExecutor,
    ExecutorHello,
    GenerateRequest,
    ModelInfo,
    Names,
    ProtocolError,
    SchedulerStats,
    StepOutputs,
    decode,
    pack_logprobs,
)
from common.sampling_params import SamplingParams
from common.service_cli import service_parser, setup_logging
from common.transport import Heartbeat, SyncTransport
from scheduler.cache_manager import CacheManager
from scheduler.request import Request, StepOutput
from scheduler.scheduler import Scheduler
from scheduler.stream_executor import ExecutorLost, StreamExecutor

logger = logging.getLogger("conveyor.scheduler")



@dataclass(slots=True)
class SchedulerServiceConfig:
    redis_url: str
    namespace: str = "conveyor"
    scheduler_id: str = "0"
    model: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_ms: int = 3000
    result_timeout_s: float = 120.0
    max_message_bytes: int = MAX_MESSAGE_BYTES


class SchedulerService:
    """One scheduler process: owns the engine state for the requests it has taken.

    Threads: the engine loop (the caller of `run`) owns the `Scheduler` and runs every step
    inline; reader threads block on the requests and control streams and hand messages over in
    thread-safe deques; a watcher aborts the requests of dead gateways; `Heartbeat` beats.
    """

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.names = Names(config.namespace)
        self.transport = SyncTransport(
            config.redis_url, self.names, max_message_bytes=config.max_message_bytes, owner=f"scheduler {config.scheduler_id}"
        )
        self.sid = config.scheduler_id
        self.inbox: deque[GenerateRequest] = deque()
        self.aborts: deque[str] = deque()
        self.wakeup = threading.Event()
        self.stopping = threading.Event()
        self.owner: dict[str, str] = {}  # request id -> gateway id (written by the engine thread only)
        self.recent_aborts: dict[str, float] = {}  # aborts that may overtake their request
        self.engine: Scheduler | None = None
        self.executor: StreamExecutor | None = None
        self.info: ExecutorInfo | None = None
        self.last_stats = 0.0
        self.step_wall_s = 0.0
        self.step_forward_s = 0.0
        self.step_count = 0

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> None:
        t = self.transport
        t.ping()
        t.ensure_group(self.names.requests, self.names.scheduler_group)
        heartbeat = Heartbeat(self.config.redis_url, self.names, "scheduler", self.sid, self.config.heartbeat_interval_s,
                              self.config.heartbeat_ttl_ms).start()
        for target in (self._read_requests, self._read_control, self._watch_gateways):
            threading.Thread(target=target, name=target.__name__.strip("_"), daemon=True).start()
        try:
            while True:
                executor = self._bind_executor()
                self.executor = executor
                self.engine = Scheduler(
                    SchedulerConfig(self.config.max_num_batched_tokens, self.config.max_num_seqs),
                    CacheManager(executor.info.num_blocks, executor.info.block_size),
                    executor,
                )
                try:
                    self._engine_loop()
                except Exception as exc:  # ExecutorLost, or an engine bug: contain it either way
                    if isinstance(exc, ExecutorLost):
                        logger.error("%s; failing %d requests", exc, len(self.owner))
                    else:
                        logger.exception("engine step failed; failing %d requests", len(self.owner))
                    self._fail_all(str(exc) if isinstance(exc, ExecutorLost) else f"engine error: {exc}")
                    self.engine = None
                    self.executor = None
        finally:
            self.stopping.set()
            heartbeat.stop()
            t.close()

    # -- executor binding ----------------------------------------------------------------------
    def _bind_executor(self) -> StreamExecutor:
        """Wait for a live executor's hello, give it a fresh epoch and publish the model info."""
        results = self.names.results(self.sid)
        t = self.transport
        cursor = t.last_id(results)
        candidates: list[ExecutorHello] = []
        for _, entry in t.call(t.redis.xrevrange, results, count=200):
            try:
                msg = decode(entry.get(ENTRY_FIELD, b""))
            except ProtocolError:
                continue
            if isinstance(msg, ExecutorHello):
                candidates.append(msg)
        logger.info("waiting for an executor on %s", results)
        while True:
            for hello in candidates:  # newest first
                if t.alive("executor", hello.executor_id):
                    return self._bind(hello, cursor)
            candidates = []
            cursors: dict[str, bytes | str] = {results: cursor}
            for _, _, msg in t.read(cursors, block_ms=1000, expected=(ExecutorHello,)):
                candidates.insert(0, msg)
            cursor = cursors[results]  # type: ignore[assignment]
            self._drop_unservable()

    def _bind(self, hello: ExecutorHello, cursor: bytes) -> StreamExecutor:
        t = self.transport
        epoch = int(t.call(t.redis.incr, self.names.epoch(self.sid)))
        t.send(self.names.steps(self.sid), BindExecutor(hello.executor_id, self.sid, epoch), maxlen=STEPS_MAXLEN)
        info = ExecutorInfo(hello.model_name, hello.num_blocks, hello.block_size, hello.max_model_len, hello.eos_token_ids, hello.vocab_size)
        self.info = info
        t.put(
            self.names.model_info,
            ModelInfo(hello.model_name, hello.model_path, hello.max_model_len, hello.vocab_size, hello.block_size,
                      hello.num_blocks, self.sid, hello.executor_id, epoch),
        )
        logger.info("bound executor %s (epoch %d): %s, %d blocks of %d", hello.executor_id, epoch, hello.model_name, hello.num_blocks, hello.block_size)
        return StreamExecutor(
            info, t, scheduler_id=self.sid, executor_id=hello.executor_id, epoch=epoch, results_cursor=cursor,
            result_timeout_s=self.config.result_timeout_s,
        )

    def _drop_unservable(self) -> None:
        """Without an executor, keep queued requests (the gateway times them out) but bound the queue."""
        while len(self.inbox) > 10_000:
            self.inbox.popleft()

    # -- background threads --------------------------------------------------------------------
    def _read_requests(self) -> None:
        # Entries taken before a crash but never acknowledged belong to this consumer: re-read.
        pending = True
        while not self.stopping.is_set():
            try:
                got = self.transport.read_group(
                    self.names.requests, self.names.scheduler_group, self.sid, block_ms=1000,
                    expected=(GenerateRequest,), pending=pending,
                )
                pending = False
                if got:
                    self.inbox.extend(msg for _, msg in got)
                    self.wakeup.set()
            except Exception:
                logger.exception("request reader failed; continuing")
                time.sleep(0.5)

    def _read_control(self) -> None:
        control = self.names.control
        cursors: dict[str, bytes | str] = {}
        while not self.stopping.is_set():
            try:
                if not cursors:
                    cursors[control] = self.transport.last_id(control)
                for _, _, msg in self.transport.read(cursors, block_ms=1000, expected=(AbortRequests,)):
                    self.aborts.extend(msg.request_ids)
                    self.wakeup.set()
            except Exception:
                logger.exception("control reader failed; continuing")
                time.sleep(0.5)

    def _watch_gateways(self) -> None:
        """Abort the requests of gateways whose heartbeat expired (their clients are gone).

        Such a gateway also gets an error output for each of them: if it is in fact alive (its
        heartbeat was only late), its clients see an error instead of waiting forever.
        """
        while not self.stopping.wait(1.0):
            try:
                owners = dict(self.owner)  # a copy: the engine thread edits the dict
                for gateway_id in set(owners.values()):
                    if self.transport.alive("gateway", gateway_id):
                        continue
                    dead = [rid for rid, gid in owners.items() if gid == gateway_id]
                    logger.warning("gateway %s is gone; aborting its %d requests", gateway_id, len(dead))
                    self.aborts.extend(dead)
                    self.wakeup.set()
                    self._send_errors(gateway_id, dead, f"gateway {gateway_id} missed its heartbeat; request aborted")
            except Exception:
                logger.exception("gateway watch failed; continuing")

    # -- engine loop ---------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        engine, executor = self.engine, self.executor
        assert engine is not None and executor is not None
        while True:
            if not engine.has_unfinished() and not self.inbox and not self.aborts:
                executor.flush()
                self._publish_stats()
                woke = self.wakeup.wait(timeout=1.0)
                self.wakeup.clear()
                # An idle executor that vanished must not take the next request down with it. Checked
                # on the idle tick only: a request that wakes the loop should not pay a round trip.
                if not woke and not engine.has_unfinished() and not self.transport.alive("executor", executor.executor_id):
                    raise ExecutorLost(f"executor {executor.executor_id} stopped (its heartbeat expired)")
            self._apply_aborts(engine, executor)
            self._admit(engine)
            if engine.has_unfinished():
                t0 = time.perf_counter()
                outputs = engine.schedule()  # also sends the previous step's outputs (executor.outbox)
                self._publish(outputs, executor)
                executor.release([o.request_id for o in outputs if o.finished])
                if not engine.has_unfinished():
                    executor.flush()  # no next step to carry them
                self.step_wall_s += time.perf_counter() - t0
                self.step_forward_s += executor.last_forward_s
                self.step_count += 1
            self._publish_stats()

    def _apply_aborts(self, engine: Scheduler, executor: StreamExecutor) -> None:
        if not self.aborts:
            return
        request_ids: list[str] = []
        while self.aborts:
            request_ids.append(self.aborts.popleft())
        now = time.monotonic()
        for request_id in request_ids:
            if engine.abort(request_id) is None:
                self.recent_aborts[request_id] = now  # may still be on its way in
            self.owner.pop(request_id, None)
        executor.release(request_ids)
        for request_id, t in list(self.recent_aborts.items()):
            if now - t > 60:
                del self.recent_aborts[request_id]
        self._publish_stats(force=True)  # freed blocks are visible at once, not after the idle tick

    def _admit(self, engine: Scheduler) -> None:
        if not self.inbox:
            return
        incoming: list[GenerateRequest] = []
        while self.inbox:
            incoming.append(self.inbox.popleft())
        errors: list[tuple[GenerateRequest, str]] = []
        for msg in incoming:
            if self.recent_aborts.pop(msg.request_id, None) is not None:
                continue
            if msg.request_id in self.owner:
                logger.warning("duplicate request id %s ignored", msg.request_id)
                continue
            try:
                params = SamplingParams(**msg.sampling)
                params.validate()
                limit = engine.max_model_len
                if len(msg.prompt_token_ids) + params.max_tokens > limit:
                    raise ValueError(
                        f"prompt ({len(msg.prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                        f"exceeds max_model_len ({limit})"
                    )
                assert self.info is not None
                if any(not 0 <= t < self.info.vocab_size for t in msg.prompt_token_ids):
                    raise ValueError(f"prompt token ids must be in [0, {self.info.vocab_size})")
                engine.add_request(Request(msg.request_id, msg.prompt_token_ids, params))
                self.owner[msg.request_id] = msg.gateway_id
            except (TypeError, ValueError) as exc:
                errors.append((msg, str(exc)))
        for msg, error in errors:
            logger.warning("rejected request %s: %s", msg.request_id, error)
            # "rejected" (not "error"): the request was bad, the engine is fine (a 400, not a 503).
            out = StepOutputs([msg.request_id], [0], [0], [], [True], ["rejected"], [error], [], [], [])
            self.transport.send(self.names.outputs(msg.gateway_id), out, maxlen=OUTPUTS_MAXLEN)

    def _publish(self, outputs: list[StepOutput], executor: StreamExecutor) -> None:
        """Queue one `StepOutputs` per gateway for this step; the next step's round trip sends them."""
        by_gateway: dict[str, StepOutputs] = {}
        for out in outputs:
            gateway_id = self.owner.get(out.request_id)
            if gateway_id is None:
                continue
            msg = by_gateway.get(gateway_id)
            if msg is None:
                msg = by_gateway[gateway_id] = StepOutputs()
            n = len(out.new_token_ids)
            msg.request_ids.append(out.request_id)
            msg.token_index.append(out.num_output_tokens - n)
            msg.num_tokens.append(n)
            msg.token_ids.extend(out.new_token_ids)
            msg.finished.append(out.finished)
            msg.finish_reasons.append(out.finish_reason)
            msg.errors.append(None)
            if out.new_logprobs and any(lp is not None for lp in out.new_logprobs):
                counts, ids, values = pack_logprobs(out.new_logprobs)
            else:  # the common case: no logprobs requested
                counts, ids, values = [-1] * n, [], []
            msg.lp_counts.extend(counts)
            msg.lp_token_ids.extend(ids)
            msg.lp_values.extend(values)
            if out.finished:
                del self.owner[out.request_id]
        for gateway_id, msg in by_gateway.items():
            if not msg.lp_token_ids:
                msg.lp_counts.clear()  # no request asked for logprobs: the gateway skips unpacking
            executor.outbox.append((self.names.outputs(gateway_id), self.transport.encode(msg), OUTPUTS_MAXLEN))

    def _send_errors(self, gateway_id: str, request_ids: list[str], error: str) -> None:
        n = len(request_ids)
        out = StepOutputs(request_ids, [0] * n, [0] * n, [], [True] * n, ["error"] * n, [error] * n, [], [], [])
        try:
            self.transport.send(self.names.outputs(gateway_id), out, maxlen=OUTPUTS_MAXLEN, deadline_s=10)
        except Exception:
            logger.exception("could not tell gateway %s about the failure", gateway_id)

    def _fail_all(self, error: str) -> None:
        if self.executor is not None:
            try:  # tokens produced before the failure go first, so each stream stays in order
                self.executor.flush()
            except Exception:
                logger.exception("could not send the last outputs")
        by_gateway: dict[str, list[str]] = {}
        for request_id, gateway_id in self.owner.items():
            by_gateway.setdefault(gateway_id, []).append(request_id)
        self.owner.clear()
        for gateway_id, request_ids in by_gateway.items():
            self._send_errors(gateway_id, request_ids, error)

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_stats < 0.1:
            return
        self.last_stats = now
        engine, info = self.engine, self.info
        executor = self.executor
        stats = SchedulerStats(
            scheduler_id=self.sid,
            epoch=executor.epoch if executor else 0,
            num_blocks=info.num_blocks if info else 0,
            num_free_blocks=engine.cache.get_num_free_blocks() if engine else 0,
            num_running=len(engine.running) if engine else 0,
            num_waiting=len(engine.waiting) if engine else 0,
            num_steps=engine.num_steps if engine else 0,
            num_preemptions=engine.num_preemptions if engine else 0,
            num_dead_letters=self.transport.num_dead_letters,
            updated_at=time.time(),
            step_wall_s=self.step_wall_s,
            step_forward_s=self.step_forward_s,
            step_count=self.step_count,
        )
        self.transport.put(self.names.stats(self.sid), stats)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = service_parser("conveyor scheduler", "Run the scheduler service.",
                       "unused (the executor reports the model); accepted for symmetry")
    p.add_argument("--scheduler-id", default=env("CONVEYOR_SCHEDULER_ID", "0"), help="pairs this scheduler with its executor")
    p.add_argument("--max-num-seqs", type=int, default=int(env("CONVEYOR_MAX_NUM_SEQS", "256")))
    p.add_argument("--max-num-batched-tokens", type=int, default=int(env("CONVEYOR_MAX_NUM_BATCHED_TOKENS", "2048")))
    p.add_argument("--result-timeout", type=float, default=float(env("CONVEYOR_RESULT_TIMEOUT", "120")),
                   help="seconds to wait for one step's result before declaring the executor lost")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    config = SchedulerServiceConfig(
        redis_url=args.redis_url, namespace=args.namespace, scheduler_id=args.scheduler_id, model=args.model,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        result_timeout_s=args.result_timeout, heartbeat_ttl_ms=args.heartbeat_ttl_ms,
        heartbeat_interval_s=max(0.1, args.heartbeat_ttl_ms / 6000),
    )
    logger.info("scheduler %s on %s (namespace %r, host %s)", config.scheduler_id, config.redis_url, config.namespace, socket.gethostname())
    try:
        SchedulerService(config).run()
    except KeyboardInterrupt:
        pass
    return 0

