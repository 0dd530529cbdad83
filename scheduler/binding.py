"""`ExecutorBinding`: how a scheduler finds, claims and binds its executor.

With a fixed ``--scheduler-id`` the executor is whichever announces itself (`ExecutorHello`) on
this scheduler's results stream: the executor started with the same id. With ``auto``
(`scheduler.pairing`) the scheduler first claims an announced, unpaired executor; the executor then
announces itself on this scheduler's streams, and is bound like any other. A thread keeps the
claim alive while the scheduler lives; losing it (taken by another scheduler after this one
stalled past its TTL) sets ``claim_lost``, which the step loop treats as the executor being lost. A
claim that lapsed and is taken back by the same scheduler needs no rebinding: the executor, claimed
again by the scheduler it served, goes on after the last step it ran (`executor.service`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from common.config import ExecutorInfo, ServiceDefaults
from common.protocol import (
    ENGINE_STREAMS_TTL_MS,
    ENTRY_FIELD,
    STEPS_MAXLEN,
    BindExecutor,
    ExecutorHello,
    ProtocolError,
    StepResult,
    decode,
)
from common.redis_errors import TRANSIENT_ERRORS
from common.transport import Outgoing, SyncTransport
from common.watchdog import Watchdog
from scheduler.pairing import ExecutorClaims
from scheduler.stream_executor import StreamExecutor

logger = logging.getLogger("conveyor.scheduler")


class ExecutorBinding:
    """The executor side of one scheduler: the last bound `ExecutorHello`, the epoch, and (with
    ``auto`` pairing) the claim on the executor."""

    def __init__(
        self,
        transport: SyncTransport,
        scheduler_id: str,
        *,
        auto: bool,
        ttl_ms: int,
        result_timeout_s: float,
        redis_restarted: threading.Event,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.transport = transport
        self.sid = scheduler_id
        self.result_timeout_s = result_timeout_s
        self.redis_restarted = redis_restarted
        self.watchdog = watchdog  # of the engine thread, which waits in the executors it binds
        self.hello: ExecutorHello | None = None  # of the executor bound last
        self.epoch = 0
        self.pairing = ExecutorClaims(transport.redis, transport.names, ttl_ms) if auto else None
        self.claimed: str | None = None  # the executor this scheduler holds a claim on (auto)
        self.claim_lost = threading.Event()
        # Held by the claim thread's refresh and the engine thread's `_claim`: a refresh that ran
        # between a release and the claim after it would take back the claim just given up.
        self._claim_lock = threading.Lock()
        self._stop = threading.Event()
        self._interval_s = ServiceDefaults.heartbeat_interval_s(ttl_ms)

    def start(self) -> ExecutorBinding:
        """Start refreshing claims (auto pairing only); returns self."""
        if self.pairing is not None:
            threading.Thread(target=self._keep_claim, name="claim", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop refreshing and give the claimed executor up at once, for another scheduler."""
        self._stop.set()
        with self._claim_lock:  # a refresh under way would take the claim back after the release
            claimed, self.claimed = self.claimed, None
        if self.pairing is not None and claimed is not None:
            try:
                self.pairing.release(claimed, self.sid)
            except TRANSIENT_ERRORS as exc:
                logger.warning("could not release executor %s (its claim expires instead): %s", claimed, exc)

    def next_epoch(self) -> int:
        """A new epoch: epochs only grow (the executor drops steps of any other), wall-clock ms."""
        self.epoch = max(self.epoch + 1, int(time.time() * 1000))
        return self.epoch

    def wait(self, stopping: threading.Event, idle: Callable[[], None]) -> StreamExecutor | None:
        """Wait for a live executor (the last one first), bind it with a new epoch (None: stopping).
        ``idle`` runs between polls (the service serves its inbox meanwhile)."""
        t = self.transport
        results = t.names.results(self.sid)
        cursor = t.last_id(results)
        candidates: list[ExecutorHello] = [self.hello] if self.hello is not None else []
        for _, entry in t.call(t.redis.xrevrange, results, count=200):
            try:
                msg = decode(entry.get(ENTRY_FIELD, b""))
            except ProtocolError:
                continue
            if isinstance(msg, ExecutorHello):
                candidates.append(msg)
        logger.info("waiting for an executor on %s", results)
        while not stopping.is_set():
            # (auto) Where the results stream ends before a claim: the executor starts serving a new
            # claim by reading the steps sent after it has seen it, and says so with a hello, which
            # may come at once; a hello from before may be of a session it has left since (to serve
            # another scheduler), and a binding sent on that one would be skipped.
            before = t.last_id(results) if self.pairing is not None else cursor
            if self._claim():
                cursor, candidates = before, []
            for hello in candidates:  # the last bound, then newest first
                if self._mine(hello.executor_id) and t.alive("executor", hello.executor_id):
                    return self._bind(hello, cursor)
            cursors: dict[str, bytes | str] = {results: cursor}
            # (late results of a lost executor may still arrive: skipped, they are no fault)
            got = t.read(cursors, block_ms=500, expected=(ExecutorHello, StepResult))
            candidates = [msg for _, _, msg in reversed(got) if isinstance(msg, ExecutorHello)]
            cursor = cursors[results]  # type: ignore[assignment]
            self.redis_restarted.clear()  # nothing in flight: nothing to redo
            idle()
        return None

    def _mine(self, executor_id: str) -> bool:
        return self.pairing is None or executor_id == self.claimed

    def _claim(self) -> bool:
        """Auto pairing: hold a claim on a live executor (keep a live one; else take an offered one).
        True when it took a new claim."""
        pairing, t = self.pairing, self.transport
        if pairing is None:
            return False
        with self._claim_lock:
            if self.claimed is not None:
                if t.alive("executor", self.claimed) and not self.claim_lost.is_set():
                    return False
                logger.info("giving up executor %s (stopped, or its claim was lost)", self.claimed)
                t.call(pairing.release, self.claimed, self.sid)
                self.claimed = None
            self.claim_lost.clear()
            for executor_id in t.call(pairing.offered):
                if t.alive("executor", executor_id) and t.call(pairing.try_claim, executor_id, self.sid):
                    logger.info("claimed executor %s", executor_id)
                    self.claimed = executor_id
                    return True
            return False

    def _keep_claim(self) -> None:
        """Refresh the claim every heartbeat interval; re-take it if it lapsed (this process stalled
        past its TTL, or Redis lost it) and nobody else took it meanwhile."""
        while not self._stop.wait(self._interval_s):
            self._refresh_claim()

    def _refresh_claim(self) -> None:
        """One refresh of `_keep_claim`."""
        assert self.pairing is not None
        with self._claim_lock:
            claimed = self.claimed
            if claimed is None:
                return
            try:
                if not self.pairing.refresh(claimed, self.sid):
                    if self.pairing.try_claim(claimed, self.sid):
                        logger.warning("the claim on executor %s had lapsed; taken back", claimed)
                    else:
                        logger.error("executor %s was claimed by another scheduler", claimed)
                        self.claim_lost.set()
            except Exception as exc:  # keep refreshing whatever happens; a miss or two is within the TTL
                logger.warning("claim refresh of %s failed: %s", claimed, exc)

    def _bind(self, hello: ExecutorHello, cursor: bytes) -> StreamExecutor:
        t = self.transport
        bind = BindExecutor(hello.executor_id, self.sid, self.next_epoch())
        # With the engine streams' TTL from the first entry: a scheduler that binds and exits before
        # its first step (with ``--scheduler-id auto``, a new id each time) leaves nothing behind.
        t.exchange([Outgoing(t.names.steps(self.sid), t.encode(bind), STEPS_MAXLEN, ENGINE_STREAMS_TTL_MS)])
        self.hello = hello
        info = ExecutorInfo(
            hello.model_name,
            hello.num_blocks,
            hello.block_size,
            hello.max_model_len,
            hello.eos_token_ids,
            hello.vocab_size,
            hello.sliding_window or None,
            list(hello.kv_group_windows),
        )
        logger.info(
            "bound executor %s (epoch %d): %s, %d blocks of %d",
            hello.executor_id,
            self.epoch,
            hello.model_name,
            hello.num_blocks,
            hello.block_size,
        )
        return StreamExecutor(
            info,
            t,
            scheduler_id=self.sid,
            executor_id=hello.executor_id,
            epoch=self.epoch,
            results_cursor=cursor,
            result_timeout_s=self.result_timeout_s,
            redis_restarted=self.redis_restarted,
            claim_lost=self.claim_lost,
            watchdog=self.watchdog,
        )
