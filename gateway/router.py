"""The gateway's side of the streams: submit requests, route outputs back, abort, watch liveness.

Each gateway has its own outputs stream (``outputs:<gateway id>``) with a single reader (this
process), so outputs of other gateways never reach it. Per request, the token index in every
output lets the reader drop duplicates and turn a gap into an error instead of wrong text.
Aborts are queued without awaiting (they are often issued from a cancelled task) and sent in
batches by a background task. A watcher fails every in-flight request with a clear error when the
scheduler's or executor's heartbeat is gone, so no client waits forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from common.protocol import AbortRequests, GenerateRequest, ModelInfo, Names, StepOutputs, unpack_logprobs
from common.transport import Heartbeat, Transport

logger = logging.getLogger("conveyor.gateway")


@dataclass(slots=True)
class EngineEvent:
    """New tokens of one request (possibly none), and whether and why it ended."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass(slots=True)
class RequestHandle:
    request_id: str
    num_prompt_tokens: int
    events: asyncio.Queue[EngineEvent] = field(default_factory=asyncio.Queue)
    next_index: int = 0
    done: bool = False


class EngineUnavailable(RuntimeError):
    """No live scheduler/executor to serve requests (answered as 503)."""


class EngineClient:
    """One gateway's connection to the engine."""

    def __init__(self, redis_url: str, names: Names, gateway_id: str, *, heartbeat_ttl_ms: int = 3000,
                 liveness_grace_s: float = 1.0) -> None:
        self.names = names
        self.gateway_id = gateway_id
        self.transport = Transport(redis_url, names, owner=f"gateway {gateway_id}")
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.liveness_grace_s = liveness_grace_s
        self.requests: dict[str, RequestHandle] = {}
        self.model_info: ModelInfo | None = None
        self.down_reason: str | None = "no scheduler has registered an executor yet"
        self._down_since: float | None = None
        self._aborts: list[str] = []
        self._abort_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat: Heartbeat | None = None
        self.redis_url = redis_url
        self.outputs_stream = names.outputs(gateway_id)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.transport.ping()
        await self.transport.beat("gateway", self.gateway_id, self.heartbeat_ttl_ms)
        cursor = await self.transport.last_id(self.outputs_stream)
        await self._check_engine()
        # On a thread: a busy event loop (many streams on a loaded CPU) must not let the heartbeat
        # lapse, or the scheduler aborts every request of this gateway.
        self._heartbeat = Heartbeat(self.redis_url, self.names, "gateway", self.gateway_id,
                                    max(0.1, self.heartbeat_ttl_ms / 6000), self.heartbeat_ttl_ms).start()
        self._tasks = [
            asyncio.create_task(self._read_outputs(cursor)),
            asyncio.create_task(self._send_aborts()),
            asyncio.create_task(self._watch_engine()),
        ]

    async def stop(self) -> None:
        if self._heartbeat is not None:
            await asyncio.to_thread(self._heartbeat.stop, 2.0)  # no beat may land after the delete below
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            if self.requests:
                await self.transport.send(self.names.control, AbortRequests(list(self.requests), "gateway stopped"), deadline_s=2)
            await self.transport.call(self.transport.redis.delete, self.outputs_stream, self.names.heartbeat("gateway", self.gateway_id), deadline_s=2)
        except Exception as exc:
            logger.warning("could not clean up on shutdown: %s", exc)
        await self.transport.close()

    # -- requests ------------------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: dict[str, object]) -> RequestHandle:
        if self.down_reason is not None:
            raise EngineUnavailable(self.down_reason)
        handle = RequestHandle(request_id, len(prompt_token_ids))
        self.requests[request_id] = handle
        msg = GenerateRequest(request_id, self.gateway_id, prompt_token_ids, sampling, time.time())
        try:
            await self.transport.send(self.names.requests, msg, deadline_s=5)
        except Exception:
            self.requests.pop(request_id, None)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` in the engine (no await: safe from a cancelled task)."""
        handle = self.requests.pop(request_id, None)
        if handle is not None and not handle.done:
            handle.done = True
            self._aborts.append(request_id)
            self._abort_event.set()

    def release(self, request_id: str) -> None:
        """Forget a request that finished normally."""
        self.requests.pop(request_id, None)

    # -- background tasks ----------------------------------------------------------------------
    async def _send_aborts(self) -> None:
        while True:
            await self._abort_event.wait()
            self._abort_event.clear()
            request_ids, self._aborts = self._aborts, []
            if request_ids:
                try:
                    await self.transport.send(self.names.control, AbortRequests(request_ids, "client"))
                except Exception:
                    logger.exception("could not send aborts")

    async def _read_outputs(self, cursor: bytes) -> None:
        cursors: dict[str, bytes | str] = {self.outputs_stream: cursor}
        while True:
            try:
                for _, _, msg in await self.transport.read(cursors, count=64, block_ms=1000, expected=(StepOutputs,)):
                    self._dispatch(msg)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("outputs reader failed; continuing")
                await asyncio.sleep(0.2)

    def _dispatch(self, msg: StepOutputs) -> None:
        logprobs = unpack_logprobs(msg.lp_counts, msg.lp_token_ids, msg.lp_values) if msg.lp_counts else None
        pos = 0
        for i, request_id in enumerate(msg.request_ids):
            n = msg.num_tokens[i]
            tokens = msg.token_ids[pos : pos + n]
            lps = logprobs[pos : pos + n] if logprobs else [None] * n
            pos += n
            handle = self.requests.get(request_id)
            if handle is None or handle.done:
                continue  # aborted or finished here already
            index = msg.token_index[i]
            if index > handle.next_index:
                self._fail(handle, f"lost output tokens {handle.next_index}..{index - 1} of request {request_id}")
                continue
            skip = handle.next_index - index  # duplicates already delivered
            tokens, lps = tokens[skip:], lps[skip:]
            handle.next_index += len(tokens)
            event = EngineEvent(tokens, lps, msg.finished[i], msg.finish_reasons[i], msg.errors[i])
            if event.finished:
                handle.done = True
            handle.events.put_nowait(event)

    def _fail(self, handle: RequestHandle, error: str) -> None:
        handle.done = True
        handle.events.put_nowait(EngineEvent([], [], True, "error", error))
        self._aborts.append(handle.request_id)
        self._abort_event.set()

    async def _check_engine(self) -> None:
        """Refresh the model info and decide whether the engine is up (sets ``down_reason``)."""
        t = self.transport
        info = await t.get(self.names.model_info, (ModelInfo,), deadline_s=2)
        if info is not None:
            self.model_info = info
        reason: str | None = None
        if info is None:
            reason = "no scheduler has registered an executor yet"
        elif not await t.alive("scheduler", info.scheduler_id, deadline_s=2):
            reason = f"scheduler {info.scheduler_id} is not running (its heartbeat expired)"
        elif not await t.alive("executor", info.executor_id, deadline_s=2):
            reason = f"executor {info.executor_id} is not running (its heartbeat expired)"
        self.down_reason = reason

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self._check_engine()
            except Exception as exc:
                self.down_reason = f"cannot reach Redis: {exc}"
            if self.down_reason is None:
                self._down_since = None
                continue
            now = time.monotonic()
            self._down_since = self._down_since or now
            if now - self._down_since >= self.liveness_grace_s and self.requests:
                logger.error("engine unavailable (%s): failing %d requests", self.down_reason, len(self.requests))
                for handle in list(self.requests.values()):
                    if not handle.done:
                        self._fail(handle, f"engine unavailable: {self.down_reason}")
