"""The gateway's side of the streams: route requests to engines, route outputs back, recover.

Engines (scheduler + executor pairs) publish `EngineStatus` keys, with a summary of what their
prefix caches hold; every 0.5 s this gateway reads them and sends each new request to the engine
whose cached prefix of its prompt outweighs its load best (`EngineClient.pick_engine`, by the
``routing`` policy of `gateway.engine.routing`; what this gateway sent an engine since counts
as load, and as cached there: `PrefixIndex`; a burst leaves in one call: `SendBatch`).
Each gateway has its own outputs stream with a single reader, so outputs of other gateways never reach it;
the token index in every output lets it drop duplicates and ask for a resend (`SyncRequest`) when some were lost.

Recovery, all driven from here because the gateway holds what a request needs to continue (its
prompt, sampling parameters and the tokens already streamed to the client):
- The engine of a request is gone (its status key expired) or restarted (a new incarnation), or
  it answers ``unknown``: the request is *migrated*: resubmitted to a live engine as prompt +
  tokens so far + the rest of its budget, under a new attempt id (``<id>~<n>``), at most
  ``migration_limit`` times. Seeded sampling depends only on (seed, position), so a seeded or
  greedy stream continues exactly as it would have.
- The engine has had no executor for two heartbeat TTLs while another one has: migrated too.
- Redis restarted (its ``run_id`` changed): every request asks its engine to resend what this
  gateway has not seen; an engine that lost the request answers ``unknown`` and it migrates.
- No engine at all: the request waits up to ``recovery_timeout_s`` for one, then fails.

Request ids: the engine request id of a request is its response id, or, when the client chose
that (``X-Request-Id``), the client's id plus ``-`` and 8 random hex digits (vLLM's rule), so
requests that share an id never share engine state or outputs. A stream's journal is named by
its response id (``GET /v1/streams/{id}`` finds it), so a client's id names at most one stream at
a time: `submit` creates the journal only if it does not exist yet (`Transport.create_stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from common.config import ServiceDefaults
from common.heartbeat import Heartbeat
from common.prefix_hash import iter_block_hashes
from common.protocol import (
    ENGINE_STREAMS_TTL_MS,
    TAKEN_OVER,
    EngineStatus,
    GenerateRequest,
    Names,
    Route,
    StepOutputs,
    SyncRequest,
    encode,
)
from common.redis_errors import REDIS_FAILURES, TRANSIENT_ERRORS
from common.transport import Outgoing, Transport
from common.watchdog import Watchdog
from gateway.engine.aborts import AbortQueue
from gateway.engine.handle import EngineEvent, EngineUnavailable, RequestHandle, RequestIdInUse, attempt_of, base_request_id
from gateway.engine.outputs import journal_write, replay, route_outputs, write_ahead
from gateway.engine.prefix_index import PrefixIndex
from gateway.engine.routing import AFFINITY_SLACK, DEFAULT_OVERLAP_WEIGHT, DEFAULT_ROUTING, choose_engine
from gateway.engine.send_batch import SendBatch
from gateway.engine.watch import EngineWatch

# Outputs reach clients at most this often by default (`EngineClient`'s ``stream_interval_ms``): 0, as read.
DEFAULT_STREAM_INTERVAL_MS = 0

__all__ = ["AFFINITY_SLACK", "EngineClient", "EngineEvent", "EngineUnavailable", "RequestHandle", "RequestIdInUse"]

logger = logging.getLogger("conveyor.gateway")
OUTPUTS_READ_COUNT = 64  # steps' outputs taken per read of this gateway's stream


class EngineClient:
    """One gateway's connection to the engines."""

    def __init__(
        self,
        redis_url: str,
        names: Names,
        gateway_id: str,
        *,
        heartbeat_ttl_ms: int = ServiceDefaults.heartbeat_ttl_ms,
        migration_limit: int = ServiceDefaults.migration_limit,
        recovery_timeout_s: float = ServiceDefaults.recovery_timeout_s,
        resume_window_s: float = ServiceDefaults.resume_window_s,
        stall_timeout_s: float = ServiceDefaults.stall_timeout_s,
        stream_interval_ms: int = DEFAULT_STREAM_INTERVAL_MS,
        routing: str = DEFAULT_ROUTING,
        routing_overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
    ) -> None:
        self.names = names
        # After delivering what one read brought, the outputs reader waits out the rest of this
        # interval: the steps meanwhile arrive as one read, one event per request (one journal entry
        # per response, one SSE chunk per choice) instead of one per step (vLLM's --stream-interval).
        self.stream_interval_s = stream_interval_ms / 1000
        self.gateway_id = gateway_id
        self.transport = Transport(redis_url, names, owner=f"gateway {gateway_id}")
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.migration_limit = migration_limit
        self.recovery_timeout_s = recovery_timeout_s
        self.journal_ttl_ms = int(resume_window_s * 1000)
        self.requests: dict[str, RequestHandle] = {}  # by response id
        self.attempts: dict[str, RequestHandle] = {}  # by engine request id
        self.engines: dict[str, EngineStatus] = {}  # live engines with a model
        self.sent_since_refresh: dict[str, int] = {}
        self.sent_blocks_since_refresh: dict[str, int] = {}  # prompt blocks (cache-aware routing's load)
        self.routing, self.routing_overlap_weight = routing, routing_overlap_weight
        self.prefixes = PrefixIndex()  # what each engine's prefix cache holds
        self.model_info: EngineStatus | None = None
        self.down_reason: str | None = "no engine has registered yet"
        self.run_id: str | None = None
        self.resync_why: str | None = None  # every stream must ask for a resend, why; kept until that is sent
        self.num_migrations = 0  # requests moved to another engine (a metric's source)
        self.redis_rtt_s: float | None = None  # the last engine refresh's first round trip (a metric's source)
        # After a Redis restart, engines need a beat to re-register: none is "gone" before this.
        self.settle_until = 0.0
        self.unbound_since: dict[str, float] = {}  # engines with no executor bound, since when (monotonic)
        self._outputs_cursors: dict[str, bytes | str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat: Heartbeat | None = None
        # Ticked by a task of the event loop: a loop blocked that long ends the process (`common.watchdog`).
        self.watchdog = Watchdog("the event loop", stall_timeout_s)
        self.redis_url = redis_url
        self.outputs_stream = names.outputs(gateway_id)
        self.aborts = AbortQueue(self.transport, gateway_id, self._to_engine)
        self.submits = SendBatch(self.transport, deadline_s=5)
        self.watch = EngineWatch(self)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the background work. Redis being down does not hold the start up (the gateway
        answers 503 until it is reachable, and stops on SIGTERM meanwhile); wrong credentials do:
        `RedisAuthFailed` propagates and the server exits with the message."""
        try:
            await self.transport.ping(deadline_s=2)
            await self.watch.refresh()  # serve at once when the engines are up
        except TRANSIENT_ERRORS as exc:
            logger.warning("Redis is not reachable yet (%s); answering 503 until it is", exc)
        # On a thread: a busy event loop (many streams on a loaded CPU) must not let the heartbeat
        # lapse, or the schedulers orphan every request of this gateway.
        self._heartbeat = Heartbeat(
            self.redis_url,
            self.names,
            "gateway",
            self.gateway_id,
            ServiceDefaults.heartbeat_interval_s(self.heartbeat_ttl_ms),
            self.heartbeat_ttl_ms,
            self.watchdog,
        ).start()
        self._tasks = [
            asyncio.create_task(self._tick()),
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self.aborts.run()),
            asyncio.create_task(self.watch.run()),
        ]

    async def stop(self) -> None:
        if self._heartbeat is not None:
            await asyncio.to_thread(self._heartbeat.stop, 2.0)  # no beat may land after the delete below
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            for handle in list(self.requests.values()):
                self.abort(handle.request_id)
            await self.aborts.flush("gateway stopped", deadline_s=2)
            # The outputs stream is left to its TTL: schedulers write to it until they apply the
            # aborts, renewing its TTL only now and then (`common.transport`), so one deleted here
            # would be made again by such a write without a TTL, and kept for good.
            await self.transport.call(self.transport.redis.delete, self.names.heartbeat("gateway", self.gateway_id), deadline_s=2)
        except Exception as exc:
            logger.warning("could not clean up on shutdown: %s", exc)
        await self.transport.close()

    # -- requests ------------------------------------------------------------------------------
    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: dict[str, Any],
        journal_id: str = "",
        journal: list[Outgoing] | None = None,
        claim: Outgoing | None = None,
        group_id: str = "",
        prefer_engine: str = "",
        priority: int = 0,
        cache_salt: str = "",
    ) -> RequestHandle:
        """Send a new request (``request_id``: unique, see `RequestHandle`) to the best live engine.

        A resumable stream has a ``journal_id`` (its response id) and the journal's first entries:
        ``journal``, written in the same round trip as the request; or, when the client chose the
        response id, ``claim``, written first and only if that journal does not exist yet, so that
        an id names one stream whichever gateways serve it (else `RequestIdInUse`). Siblings (one
        prompt's ``n`` samples) share a ``group_id`` and go to the first one's engine (``prefer_engine``).
        """
        if self.down_reason is not None:
            raise EngineUnavailable(self.down_reason)
        if claim is not None and not await self.transport.create_stream(claim, deadline_s=5):
            raise RequestIdInUse(f"a stream with id {journal_id!r} is in flight or still resumable")
        handle = RequestHandle(
            request_id,
            prompt_token_ids,
            sampling,
            journal_id,
            group_id=group_id,
            prefer_engine=prefer_engine,
            priority=priority,
            cache_salt=cache_salt,
        )
        self.requests[request_id] = handle
        try:
            if not await self._route(handle, journal or []):
                raise EngineUnavailable("no live engine")
        except BaseException:  # cancelled too: a handle left here would be resent, kept and counted for good
            self._forget(handle)
            if claim is not None:  # the stream never started: its id is free again
                with contextlib.suppress(Exception):
                    await self.transport.call(self.transport.redis.delete, claim.stream, deadline_s=2)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` in the engine (no await: safe from a cancelled task)."""
        if (handle := self.requests.get(request_id)) is not None:
            self._forget(handle)
            if not handle.done:
                handle.done = True
                self.aborts.add(handle.scheduler_id, handle.engine_request_id)

    def release(self, request_id: str) -> None:
        """Forget a request that finished normally."""
        if (handle := self.requests.get(request_id)) is not None:
            self._forget(handle)

    def _forget(self, handle: RequestHandle) -> None:
        self.requests.pop(handle.request_id, None)
        self.attempts.pop(handle.engine_request_id, None)

    def _to_engine(self, scheduler_id: str, msg: Any) -> Outgoing:
        """A message for an engine's requests stream; its TTL is refreshed, so the stream of an
        engine that never comes back expires (a live scheduler trims it as it reads)."""
        return Outgoing(self.names.requests(scheduler_id), encode(msg), None, ENGINE_STREAMS_TTL_MS)

    def load_of(self, status: EngineStatus) -> int:
        return status.load + self.sent_since_refresh.get(status.scheduler_id, 0)

    def prompt_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """The block hashes of a prompt as the engines' prefix caches key it (empty unless routing
        is cache-aware). Engines of one model share a block size: the first known one is used."""
        block = next((e.block_size for e in self.engines.values() if e.block_size > 0), 0)
        if self.routing != "cache_aware" or block < 1:
            return []
        return list(iter_block_hashes(prompt_token_ids, block, cache_salt or None))

    def pick_engine(
        self, prompt_token_ids: Sequence[int] = (), priority: int = 0, hashes: Sequence[bytes] | None = None
    ) -> EngineStatus | None:
        """Where a request should run (`gateway.engine.routing.choose_engine`, by ``hashes``: the
        prompt's `prompt_hashes`); one with a priority only where the priority scheduling policy
        takes it (an fcfs engine would refuse it)."""
        engines = list(self.engines.values())
        if priority:
            engines = [e for e in engines if e.scheduling_policy == "priority"]
        keys = self.prompt_hashes(prompt_token_ids) if hashes is None else hashes
        return choose_engine(
            engines,
            self.load_of,
            prompt_token_ids,
            policy=self.routing,
            overlap_of=lambda e: self.prefixes.overlap(e.scheduler_id, keys),
            sent_blocks_of=lambda e: self.sent_blocks_since_refresh.get(e.scheduler_id, 0),
            overlap_weight=self.routing_overlap_weight,
        )

    def set_engines(self, engines: dict[str, EngineStatus]) -> None:
        """Take a fresh read of the live engines' statuses (what was counted since the last is in them)."""
        self.engines, self.sent_since_refresh, self.sent_blocks_since_refresh = engines, {}, {}
        self.prefixes.update(engines)

    def count_routed(self, engine: EngineStatus, prompt_token_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        """A request with this prompt (block hashes ``hashes``, `prompt_hashes`) went to ``engine``:
        until its status is read again, it counts as load there, its new blocks as blocks in use,
        and (a while longer) its blocks as cached there."""
        sid = engine.scheduler_id
        self.sent_since_refresh[sid] = self.sent_since_refresh.get(sid, 0) + 1
        if engine.block_size > 0:
            new = len(prompt_token_ids) // engine.block_size - self.prefixes.overlap(sid, hashes)
            self.sent_blocks_since_refresh[sid] = self.sent_blocks_since_refresh.get(sid, 0) + max(0, new)
        self.prefixes.remember(sid, hashes)

    async def _route(self, handle: RequestHandle, extra: list[Outgoing]) -> bool:
        """Submit ``handle``'s next attempt to the best engine; False if none is live."""
        engine = self.engines.get(handle.prefer_engine) if handle.attempts == 0 else None  # a sibling's
        # Hashed for a sibling too: its prompt's blocks are the first one's, just counted there.
        hashes = self.prompt_hashes(handle.prompt_token_ids, handle.cache_salt)
        if engine is None or not engine.executor_id:
            engine = self.pick_engine(handle.prompt_token_ids, handle.priority, hashes)
        if engine is None:
            return False
        self.attempts.pop(handle.engine_request_id, None)
        handle.engine_request_id = handle.request_id if handle.attempts == 0 else f"{handle.request_id}~{handle.attempts}"
        handle.attempts += 1
        handle.scheduler_id, handle.incarnation = engine.scheduler_id, engine.incarnation
        unrouted_since, handle.unrouted_since, handle.sync_from = handle.unrouted_since, None, -1
        self.attempts[handle.engine_request_id] = handle
        msg = GenerateRequest(
            handle.engine_request_id,
            self.gateway_id,
            engine.scheduler_id,
            engine.incarnation,
            handle.prompt_token_ids,
            list(handle.output_token_ids),
            handle.sampling,
            time.time(),
            handle.journal_id,
            handle.group_id,
            handle.priority,
            handle.cache_salt,
        )
        sends = list(extra)
        if handle.journal_id:
            route = Route(handle.engine_request_id, engine.scheduler_id)
            sends.append(Outgoing(self.names.journal(handle.journal_id), encode(route), None, self.journal_ttl_ms))
        sends.append(self._to_engine(engine.scheduler_id, msg))
        # Counted before the await: requests routed concurrently must see each other's choice.
        self.count_routed(engine, handle.prompt_token_ids, hashes)
        try:
            await self.submits.send(sends)
        except BaseException:
            # Not sent, or sent and its reply lost: an abort after it (same stream) stops the attempt
            # if it landed; and a move that failed is still one to make (`EngineWatch.check_routes` retries it),
            # not one made (its id stays used: the abort names it).
            self.aborts.add(engine.scheduler_id, handle.engine_request_id)
            handle.unrouted_since, handle.failed_routes = unrouted_since, handle.failed_routes + 1
            raise
        handle.resend_owed = False  # the new attempt starts from what this gateway has
        if handle.journal_id:
            handle.journaled_at = time.monotonic()
        return True

    async def migrate(self, handle: RequestHandle, why: str) -> None:
        """Resubmit ``handle`` elsewhere with the tokens it has (see the module docstring)."""
        if handle.done:
            return
        if handle.unrouted_since is None:  # first try for this move: stop the old attempt, count it
            logger.warning("request %s: %s; migrating (attempt %d)", handle.request_id, why, handle.attempts + 1)
            self.aborts.add(handle.scheduler_id, handle.engine_request_id)
            handle.unrouted_since = time.monotonic()
            self.num_migrations += 1
        if handle.attempts - handle.failed_routes > self.migration_limit:
            await self._fail(handle, f"request moved between engines {self.migration_limit} times; giving up ({why})")
        elif len(handle.output_token_ids) >= int(handle.sampling.get("max_tokens", 0)):
            self._deliver(handle, EngineEvent([], [], True, "length"))  # only its last output was lost
        elif not await self._try_route(handle):
            if time.monotonic() - handle.unrouted_since > self.recovery_timeout_s:
                await self._fail(handle, f"no live engine for {self.recovery_timeout_s:.0f}s ({why})")

    async def _try_route(self, handle: RequestHandle) -> bool:
        """`_route` for a move: a send that fails leaves the move to retry (False)."""
        try:
            return await self._route(handle, [])
        except REDIS_FAILURES as exc:
            logger.warning("request %s: could not move it (%s); trying again", handle.request_id, exc)
            return False

    # -- resuming a stream another gateway served ------------------------------------------------
    async def adopt(
        self,
        journal_id: str,
        prompt_token_ids: list[int],
        sampling: dict[str, Any],
        route: Route,
        outputs: list[StepOutputs],
        priority: int = 0,
        cache_salt: str = "",
    ) -> RequestHandle:
        """A handle for a journaled stream: its journaled events first, then (unless it finished)
        the live ones, once its engine routes the request here (`SyncRequest`)."""
        request_id = base_request_id(route.request_id)
        if request_id in self.requests:  # two handles of one stream: each would take the other's outputs
            raise RequestIdInUse("the stream is already being served by this gateway")
        handle = RequestHandle(
            request_id,
            prompt_token_ids,
            sampling,
            journal_id=journal_id,
            engine_request_id=route.request_id,
            scheduler_id=route.scheduler_id,
            attempts=attempt_of(route.request_id) + 1,
            priority=priority,
            cache_salt=cache_salt,
        )
        for event in replay(handle, outputs):  # as `_dispatch` delivered them
            self._deliver(handle, event)
        if handle.done:
            return handle  # the whole stream is in the journal
        status = self.engines.get(route.scheduler_id)
        handle.incarnation = status.incarnation if status is not None else ""  # else: the watcher migrates it
        self.requests[request_id] = self.attempts[route.request_id] = handle
        dropped = False
        try:
            dropped = await self.aborts.withdraw(route.scheduler_id, route.request_id, deadline_s=5)  # its client hung up here?
            await self.resend(handle)
        except BaseException:  # not adopted: a retry (here or elsewhere) must find the stream free
            self._forget(handle)
            if dropped:  # and the abort it dropped still holds
                self.aborts.add(route.scheduler_id, route.request_id)
            raise
        return handle

    # -- background tasks ----------------------------------------------------------------------
    async def _tick(self) -> None:
        while True:
            self.watchdog.tick()
            await asyncio.sleep(ServiceDefaults.liveness_check_s)

    async def _read_outputs(self) -> None:
        cursors: dict[str, bytes | str] = {self.outputs_stream: await self.transport.last_id(self.outputs_stream)}
        self._outputs_cursors = cursors  # `EngineWatch.run` trims what was read
        while True:
            try:
                received = await self.transport.read(cursors, count=OUTPUTS_READ_COUNT, block_ms=1000, expected=(StepOutputs,))
                read_at = time.monotonic()
                if received:
                    await self._dispatch([msg for _, _, msg in received])
                if self.stream_interval_s and 0 < len(received) < OUTPUTS_READ_COUNT:  # a full read: more are waiting
                    await asyncio.sleep(max(0.0, read_at + self.stream_interval_s - time.monotonic()))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("outputs reader failed; continuing")
                await asyncio.sleep(0.2)

    async def _dispatch(self, msgs: list[StepOutputs]) -> None:
        """Deliver the outputs of consecutive steps (one event per request: `route_outputs`);
        resumable streams are journaled before their clients see them."""
        routed = route_outputs(msgs, self.attempts)
        events = await write_ahead(self.transport, self.names, routed.events, self.journal_ttl_ms)
        for handle, event, _ in events:
            self._deliver(handle, event)
        for handle, why in routed.taken:  # the stream goes on elsewhere: nothing is journaled
            if not handle.done:
                logger.warning("request %s: %s; this copy ends", handle.request_id, why)
                self._deliver(handle, EngineEvent([], [], True, TAKEN_OVER, why))
        await self.watch.sync_each(routed.syncs)
        for handle in routed.migrate:
            await self.migrate(handle, "its engine does not hold it")

    def _deliver(self, handle: RequestHandle, event: EngineEvent) -> None:
        if event.finished:
            handle.done = True
        handle.events.put_nowait(event)

    async def resend(self, handle: RequestHandle) -> None:
        """Ask the engine to resend from what this gateway has (outputs were lost)."""
        before, handle.sync_from = handle.sync_from, handle.next_index
        msg = SyncRequest(handle.engine_request_id, self.gateway_id, handle.next_index)
        try:
            await self.submits.send([self._to_engine(handle.scheduler_id, msg)])
        except BaseException:
            # Not asked: the next gap asks again, and `EngineWatch.run` does if none comes (the lost outputs
            # may have been the last).
            handle.sync_from, handle.resend_owed = before, True
            raise
        handle.resend_owed = False

    async def _fail(self, handle: RequestHandle, error: str) -> None:
        logger.error("request %s failed: %s", handle.request_id, error)
        handle.done = True  # at once: nothing else is delivered to it, nor fails it again, while this awaits
        event = EngineEvent([], [], True, "error", error)
        if handle.journal_id:  # journaled as the engine's events are: a client resuming later gets the error, not a 404
            entry = journal_write(self.names, handle, event, handle.next_index, self.journal_ttl_ms)
            with contextlib.suppress(*REDIS_FAILURES):  # Redis may be why it failed: the client here still gets it
                await self.transport.send_many([entry], deadline_s=2)
        self._deliver(handle, event)
        self.aborts.add(handle.scheduler_id, handle.engine_request_id)
