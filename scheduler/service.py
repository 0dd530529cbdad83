"""`conveyor scheduler`: the engine loop as a service between the gateways and one executor.

One scheduler and its executor (paired by ``--scheduler-id``, or claimed with ``auto``: see
`scheduler.binding`) form an *engine replica*; any number of them share one Redis and serve the
same model. The scheduler owns every request it has taken:
it builds the very `Scheduler` and `CacheManager` the offline `LLM` uses, with a `StreamExecutor`,
and loops: take requests, aborts and syncs from its own requests stream (read by a background
thread, in order), run one step inline, route the outputs (`OutputRouter`).

Faults, and what survives them:
- The executor dies, hangs or Redis restarts under a step (`ExecutorLost`): every running request
  is preempted and kept; when an executor binds (the same one once it is back, a restarted one or
  a standby), they are recomputed there and go on. Only after ``--recovery-timeout`` with no
  executor do they fail, with a clear error.
- A step fails (`StepFailed`): its requests run one per step until the one that fails alone is
  found and failed; the others go on.
- A gateway dies: its resumable requests are orphaned (journaled) for ``--resume-window``, the
  others aborted (`OutputRouter`).
- This scheduler dies: its `EngineStatus` key expires (or comes back with a new incarnation) and
  the gateways migrate its requests to live engines; a new incarnation ignores everything sent
  to its predecessor.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

from common.config import SchedulerConfig, ServiceDefaults
from common.protocol import MAX_MESSAGE_BYTES, AbortRequests, EngineStatus, GenerateRequest, Names, SyncRequest
from common.redis_errors import TRANSIENT_ERRORS
from common.sampling_params import sampling_from_dict
from common.service_cli import AUTO, record_process_id
from common.transport import Outgoing, SyncTransport
from common.watchdog import Watchdog
from scheduler.binding import ExecutorBinding
from scheduler.engine_core import EngineCore
from scheduler.engine_status import EngineBeat, engine_status
from scheduler.kv_groups import cache_manager_for
from scheduler.outputs import OutputRouter
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.stream_executor import ExecutorLost, StepFailed, StreamExecutor

logger = logging.getLogger("conveyor.scheduler")

InboxMessage = GenerateRequest | AbortRequests | SyncRequest


@dataclass(slots=True)
class SchedulerServiceConfig:
    redis_url: str
    namespace: str = ServiceDefaults.namespace
    scheduler_id: str = "0"
    max_num_seqs: int = SchedulerConfig().max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig().max_num_batched_tokens
    enable_prefix_caching: bool = SchedulerConfig().enable_prefix_caching
    async_scheduling: bool = SchedulerConfig().async_scheduling
    steps_in_flight: int = SchedulerConfig().steps_in_flight
    scheduling_policy: str = SchedulerConfig().scheduling_policy
    heartbeat_ttl_ms: int = ServiceDefaults.heartbeat_ttl_ms
    result_timeout_s: float = ServiceDefaults.result_timeout_s
    stall_timeout_s: float = ServiceDefaults.stall_timeout_s
    recovery_timeout_s: float = ServiceDefaults.recovery_timeout_s
    resume_window_s: float = ServiceDefaults.resume_window_s
    max_message_bytes: int = MAX_MESSAGE_BYTES

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's `SchedulerConfig` (validated: a bad limit stops the service at start)."""
        config = SchedulerConfig(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching,
            async_scheduling=self.async_scheduling,
            steps_in_flight=self.steps_in_flight,
            max_step_bytes=self.max_message_bytes // 2,
            scheduling_policy=self.scheduling_policy,
        )
        config.validate()
        return config

    @property
    def heartbeat_interval_s(self) -> float:
        return ServiceDefaults.heartbeat_interval_s(self.heartbeat_ttl_ms)


class SchedulerService:
    """One scheduler process: owns the engine state of the requests it has taken.

    Threads: the engine loop (the caller of `run`) owns the `Scheduler`, the `OutputRouter` and
    every step; a reader thread moves the requests stream into `inbox`; a watcher reports dead
    gateways; `EngineBeat` publishes liveness and load.
    """

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.names = Names(config.namespace)
        # `auto`: an id of its own, and the executor is claimed (`scheduler.pairing`)
        self.sid = f"s-{uuid.uuid4().hex[:10]}" if config.scheduler_id == AUTO else config.scheduler_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.transport = SyncTransport(
            config.redis_url, self.names, max_message_bytes=config.max_message_bytes, owner=f"scheduler {self.sid}"
        )
        self.inbox: deque[InboxMessage] = deque()
        self.dead_gateways: deque[str] = deque()
        self.revived_gateways: deque[str] = deque()  # declared dead, but beating again
        self.wakeup = threading.Event()
        self.stopping = threading.Event()
        self.redis_restarted = threading.Event()
        # Ticked on every turn of the engine thread (its waits are bounded); see `common.watchdog`.
        self.watchdog = Watchdog("the engine thread", config.stall_timeout_s)
        self.binding = ExecutorBinding(
            self.transport,
            self.sid,
            auto=config.scheduler_id == AUTO,
            ttl_ms=config.heartbeat_ttl_ms,
            result_timeout_s=config.result_timeout_s,
            redis_restarted=self.redis_restarted,
            watchdog=self.watchdog,
        )
        self.router = OutputRouter(self.names, config.resume_window_s, config.max_message_bytes)
        self.engine: Scheduler | None = None
        self.executor: StreamExecutor | None = None
        # When the executor was lost; None once a bound one answers a step. Binding one is not
        # enough: a stuck executor whose heartbeat goes on is rebound after every result timeout.
        self.lost_since: float | None = None
        self.settle_until = 0.0  # after a Redis restart, no gateway is declared dead before this
        self.beat: EngineBeat | None = None
        self.last_poke = 0.0
        self.step_wall_s = 0.0
        self.step_forward_s = 0.0
        self.step_count = 0

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> None:
        t = self.transport
        t.ping()
        # Whatever waits in the requests stream was sent to a predecessor; its gateways migrate it.
        cursor = t.last_id(self.names.requests(self.sid))
        t.trim_through(self.names.requests(self.sid), cursor)
        self.beat = EngineBeat(
            self.config.redis_url,
            self.names,
            self.sid,
            self.config.heartbeat_interval_s,
            self.config.heartbeat_ttl_ms,
            self.status,
            self._on_redis_restart,
            self.watchdog,
        ).start()
        threading.Thread(target=self._read_requests, args=(cursor,), name="requests", daemon=True).start()
        threading.Thread(target=self._watch_gateways, name="gateways", daemon=True).start()
        self.binding.start()
        record_process_id("scheduler", self.sid)
        logger.info("scheduler %s up (incarnation %s)", self.sid, self.incarnation)
        try:
            while not self.stopping.is_set():
                executor = self.binding.wait(self.stopping, self._idle)
                if executor is None:
                    break
                config = self.config.scheduler_config()
                cache = cache_manager_for(executor.info, config)
                if self.engine is None:
                    self.engine = Scheduler(config, cache, executor.info)
                else:
                    for request_id, why in self.engine.reset_executor(executor.info, cache).items():
                        self._send(self.router.errors([request_id], f"the executor that took over cannot serve it: {why}"))
                core = EngineCore(self.engine, executor, config.async_scheduling, config.steps_in_flight)
                self.executor = executor
                if not self.engine.requests:
                    self.lost_since = None  # nothing waited through the loss: a later one starts afresh
                try:
                    self._engine_loop(core, executor)
                except ExecutorLost as exc:
                    logger.error("%s; keeping %d requests until an executor binds", exc, len(self.engine.requests))
                    self._flush(executor)
                except Exception as exc:  # an engine bug: fail what was in flight, keep serving
                    logger.exception("engine step failed; failing %d requests", len(self.engine.requests))
                    self._flush(executor, outputs_only=True)
                    request_ids = list(self.engine.requests)
                    self.engine = None
                    self._send(self.router.errors(request_ids, f"engine error: {exc}"))
                self.executor = None
                if self.lost_since is None:
                    self.lost_since = time.monotonic()
                self._check_recovery_timeout()
        finally:
            self.stopping.set()
            self.binding.close()
            if self.beat is not None:
                self.beat.stop(wait_s=5.0)
                try:
                    t.call(self.beat.withdraw, deadline_s=2)
                except TRANSIENT_ERRORS as exc:  # its keys expire with their TTL instead
                    logger.warning("could not take this engine out of Redis: %s", exc)
            t.close()

    def status(self) -> EngineStatus:
        """This engine's liveness, model and load (read by `EngineBeat` on its thread)."""
        return engine_status(self)

    def _on_redis_restart(self) -> None:
        self.transport.forget_renewals()  # the streams written since are new keys: they need their TTLs
        self.settle_until = time.monotonic() + self.config.heartbeat_ttl_ms / 1000
        self.redis_restarted.set()
        self.wakeup.set()

    # -- executor binding ----------------------------------------------------------------------
    def _idle(self) -> None:
        """Between polls for an executor: serve the inbox, fail requests past the recovery timeout."""
        self.watchdog.tick()
        self._serve_inbox()
        self._check_recovery_timeout()

    def _check_recovery_timeout(self) -> None:
        """Without an executor for ``recovery_timeout_s``, requests fail instead of waiting on."""
        engine = self.engine
        if engine is None or self.lost_since is None or not engine.requests:
            return
        waited = time.monotonic() - self.lost_since
        if waited < self.config.recovery_timeout_s:
            return
        request_ids = list(engine.requests)
        logger.error("no executor for %.0fs: failing %d requests", waited, len(request_ids))
        for request_id in request_ids:
            engine.abort(request_id, "error")
        error = f"engine {self.sid} has had no executor for {waited:.0f}s (recovery timeout)"
        self._send(self.router.errors(request_ids, error))

    # -- background threads --------------------------------------------------------------------
    def _read_requests(self, cursor: bytes) -> None:
        """Move the requests stream into `inbox` in order, trimming what was taken."""
        stream = self.names.requests(self.sid)
        cursors: dict[str, bytes | str] = {stream: cursor}
        while not self.stopping.is_set():
            try:
                got = self.transport.read(cursors, block_ms=1000, expected=(GenerateRequest, AbortRequests, SyncRequest))
                if got:
                    self.inbox.extend([msg for _, _, msg in got])  # a list: one batch lands at once
                    self.wakeup.set()
                if cursors[stream] != cursor:
                    cursor = cursors[stream]  # type: ignore[assignment]
                    self.transport.trim_through(stream, cursor)
            except Exception:
                logger.exception("request reader failed; continuing")
                time.sleep(0.5)

    def _watch_gateways(self) -> None:
        """Report gateways whose heartbeat expired to the engine thread (see `OutputRouter`).

        A gateway is dead once its key has been missing for half a TTL more (one slow beat is not
        death), and none is declared dead within a TTL of a Redis restart (they re-beat first).
        """
        grace_s = self.config.heartbeat_ttl_ms / 2000
        missing_since: dict[str, float] = {}
        while not self.stopping.wait(ServiceDefaults.liveness_check_s):
            try:
                owners, origins = self.router.gateways()
                now = time.monotonic()
                for gateway_id in owners | origins:
                    alive = self.transport.alive("gateway", gateway_id)
                    if alive or now < self.settle_until:
                        missing_since.pop(gateway_id, None)
                    else:
                        missing_since.setdefault(gateway_id, now)
                    if gateway_id in owners and not alive and now - missing_since.get(gateway_id, now) >= grace_s:
                        self.dead_gateways.append(gateway_id)
                        self.wakeup.set()
                    elif gateway_id in origins and alive:
                        self.revived_gateways.append(gateway_id)
                        self.wakeup.set()
            except Exception:
                logger.exception("gateway watch failed; continuing")

    # -- engine loop ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Make `run` return (from another thread); it cleans up on the way out."""
        self.stopping.set()
        self.wakeup.set()

    def _engine_loop(self, core: EngineCore, executor: StreamExecutor) -> None:
        while not self.stopping.is_set():
            self.watchdog.tick()
            if not core.has_work() and not self.inbox and not self.dead_gateways and not self.revived_gateways:
                self.lost_since = None  # nothing waits for the executor
                self._flush(executor)
                woke = self.wakeup.wait(timeout=1.0)
                self.wakeup.clear()
                self.redis_restarted.clear()  # nothing in flight: nothing to redo
                # An idle executor that vanished must not take the next request down with it. Checked
                # on the idle tick only: a request that wakes the loop should not pay a round trip.
                if not woke and not self.transport.alive("executor", executor.executor_id):
                    raise ExecutorLost(f"executor {executor.executor_id} stopped (its heartbeat expired)")
                if self.binding.claim_lost.is_set():
                    raise ExecutorLost(f"executor {executor.executor_id} was claimed by another scheduler")
            self._serve_inbox()
            if not core.has_work():
                continue
            t0 = time.perf_counter()
            try:
                outputs = core.step()  # the round trip also carries the previous outputs (executor.outbox)
            except StepFailed as exc:
                self._step_failed(core, executor, exc)
                continue
            executor.outbox.extend(self.router.route(outputs))
            if not core.has_work():
                self._flush(executor)  # no next step to carry them
            self.step_wall_s += time.perf_counter() - t0
            if core.collected:  # a call that only sent a step (the pipeline filling) executed none
                self.step_forward_s += executor.last_forward_s
                self.step_count += 1
                self.lost_since = None
            if t0 - self.last_poke > 0.1:
                self.last_poke = t0
                self._poke()

    def _step_failed(self, core: EngineCore, executor: StreamExecutor, exc: StepFailed) -> None:
        """The executor dropped its state (`EngineCore` has reset ours): rebind it with a new epoch,
        then find the request that fails alone and fail only it."""
        engine = core.scheduler
        executor.rebind(self.binding.next_epoch())
        culprit = engine.step_failed(core.failed_request_ids)
        if culprit is not None:
            logger.error("request %s fails the step alone: %s", culprit, exc)
            self._send(self.router.errors([culprit], f"request failed in the executor: {exc}"))
        else:
            logger.error("%s; retrying its requests one at a time", exc)

    def _serve_inbox(self) -> None:
        """Admit requests, apply aborts and syncs, orphan the requests of dead gateways."""
        engine = self.engine
        if engine is None:  # no executor has ever bound: nothing can be validated yet
            if len(self.inbox) > 10_000:
                self.inbox.popleft()
            return
        sends: list[Outgoing] = []
        aborted: list[str] = []
        aborts: list[tuple[str, str]] = []  # (request, from gateway): checked once the syncs are applied (`may_abort`)
        while self.inbox:
            msg = self.inbox.popleft()
            if isinstance(msg, GenerateRequest):
                error = self._admit(engine, msg)
                if error is not None:
                    logger.warning("rejected request %s: %s", msg.request_id, error)
                    sends.append(self.router.reject(msg.request_id, msg.gateway_id, error))
            elif isinstance(msg, AbortRequests):
                aborts.extend((r, msg.gateway_id) for r in msg.request_ids)
            elif not msg.gateway_id:  # would route the request's outputs to no gateway's stream
                logger.warning("sync for %s names no gateway; ignored", msg.request_id)
            else:  # it makes an earlier abort from its own gateway stale: the client resumed there (`gateway.engine.aborts`)
                aborts = [a for a in aborts if a != (msg.request_id, msg.gateway_id)]
                sends.extend(
                    self.router.adopt(engine.requests.get(msg.request_id), msg.request_id, msg.gateway_id, msg.from_index)
                )
        aborted.extend(r for r, gateway_id in aborts if self.router.may_abort(r, gateway_id))
        now = time.monotonic()
        while self.dead_gateways:
            gateway_id = self.dead_gateways.popleft()
            # Its outputs stream may lapse meanwhile: one that comes back under the same id has it
            # made anew, and it needs its TTL at the first write.
            self.transport.forget_renewals()
            doomed = self.router.gateway_died(gateway_id, now)
            logger.warning("gateway %s is gone: %d requests aborted, the resumable ones kept", gateway_id, len(doomed))
            aborted.extend(doomed)
        while self.revived_gateways:  # only late, not dead: it gets its requests back
            gateway_id = self.revived_gateways.popleft()
            for r in self.router.orphans_of(gateway_id):
                sends.extend(self.router.adopt(engine.requests.get(r), r, gateway_id, 0))
        aborted.extend(self.router.expired_orphans(now))
        for request_id in aborted:
            engine.abort(request_id)
            self.router.forget(request_id)
        self._send(sends)
        if aborted:
            self._poke()  # freed blocks are visible at once

    def _admit(self, engine: Scheduler, msg: GenerateRequest) -> str | None:
        """Add one request; the reason it was refused, or None."""
        if msg.incarnation != self.incarnation:
            logger.info("request %s was sent to a previous incarnation; its gateway migrates it", msg.request_id)
            return None
        if msg.request_id in engine.requests:
            logger.warning("duplicate request id %s ignored", msg.request_id)
            return None
        assert self.binding.hello is not None
        try:
            params = sampling_from_dict(msg.sampling)
            params.validate(self.binding.hello.vocab_size)
            if len(msg.output_token_ids) >= params.max_tokens:
                raise ValueError(f"{len(msg.output_token_ids)} tokens already generated of max_tokens {params.max_tokens}")
            request = Request(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                group_id=msg.group_id or None,
                priority=msg.priority,
                cache_salt=msg.cache_salt or None,
            )
            request.output_token_ids = list(msg.output_token_ids)
            request.output_logprobs = [None] * len(msg.output_token_ids)
            request.check_servable(engine.max_model_len, self.binding.hello.vocab_size)
            engine.add_request(request)
        except (TypeError, ValueError, RecursionError) as exc:  # refused alone, whatever the stream carried
            return str(exc)
        self.router.add(msg.request_id, msg.gateway_id, msg.journal_id)
        sizes = len(msg.prompt_token_ids), len(msg.output_token_ids)
        logger.debug("request %s admitted from gateway %s: %d prompt, %d output tokens", msg.request_id, msg.gateway_id, *sizes)
        return None

    def _send(self, sends: list[Outgoing]) -> None:
        if sends:
            try:
                self.transport.exchange(sends, deadline_s=10)
            except Exception:
                logger.exception("could not send %d messages", len(sends))

    def _flush(self, executor: StreamExecutor, outputs_only: bool = False) -> None:
        try:
            executor.flush_outputs() if outputs_only else executor.flush()
        except Exception:
            logger.exception("could not send the last outputs")

    def _poke(self) -> None:
        if self.beat is not None:
            self.beat.poke()
