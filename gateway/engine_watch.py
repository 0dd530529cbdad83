"""The gateway's watch over the engines (`EngineWatch`, a part of `gateway.router.EngineClient`).

Every ``liveness_check_s`` it re-reads the live engines and Redis's ``run_id`` (`_refresh`), trims
what this gateway read of its outputs stream, asks again for resends it could not ask for, moves
each request whose engine is gone, restarted or without an executor (`_check_routes`), and keeps
the journals of the streams it serves alive (`_keep_journals`). The recovery this drives is
described in `gateway.router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from common.config import ServiceDefaults
from common.protocol import EngineStatus, Names
from common.redis_errors import REDIS_FAILURES
from common.transport import Transport
from gateway.engine_choice import reason_to_leave
from gateway.request_handle import RequestHandle

logger = logging.getLogger("conveyor.gateway")


class EngineWatch:
    """The watch loop of an `EngineClient`, which sets these fields and defines `_sync` and
    `_migrate` (declared here for the loop's use)."""

    transport: Transport
    names: Names
    heartbeat_ttl_ms: int
    journal_ttl_ms: int
    requests: dict[str, RequestHandle]
    engines: dict[str, EngineStatus]
    sent_since_refresh: dict[str, int]
    model_info: EngineStatus | None
    down_reason: str | None
    run_id: str | None
    resync_why: str | None
    redis_rtt_s: float | None
    settle_until: float
    unbound_since: dict[str, float]
    outputs_stream: str
    _outputs_cursors: dict[str, bytes | str]

    async def _sync(self, handle: RequestHandle) -> None:
        """Ask ``handle``'s engine to resend what this gateway misses (`EngineClient._sync`)."""
        raise NotImplementedError

    async def _migrate(self, handle: RequestHandle, why: str) -> None:
        """Move ``handle`` to another engine (`EngineClient._migrate`)."""
        raise NotImplementedError

    async def _sync_each(self, handles: list[RequestHandle]) -> None:
        """`_sync` each of ``handles`` (one Redis call); one that fails is owed (`_watch`)."""
        results = await asyncio.gather(*(self._sync(h) for h in handles if not h.done), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("could not ask for %d resends (%s); asking again shortly", len(failed), failed[0])

    async def _resend_owed(self) -> None:
        """Ask again for the resends that could not be asked for (`RequestHandle.resend_owed`)."""
        await self._sync_each([h for h in self.requests.values() if h.resend_owed and h.unrouted_since is None])

    async def _refresh(self) -> None:
        """Re-read the live engines and decide whether this gateway can serve (``down_reason``)."""
        t, t0 = self.transport, time.perf_counter()
        run_id = await t.run_id(deadline_s=2)
        self.redis_rtt_s = time.perf_counter() - t0  # one round trip (plus retries, if Redis is slow to answer)
        if self.run_id is not None and run_id != self.run_id:  # engines need a beat to re-register
            self.settle_until, self.resync_why = time.monotonic() + self.heartbeat_ttl_ms / 1000, "Redis restarted"
        self.run_id = run_id
        ids = [sid.decode() for sid in await t.call(t.redis.zrange, self.names.engines, 0, -1, deadline_s=2)]
        values = await t.call(t.redis.mget, [self.names.engine(sid) for sid in ids], deadline_s=2) if ids else []
        engines: dict[str, EngineStatus] = {}
        for sid, value in zip(ids, values):
            status = t.decode_value(self.names.engine(sid), value, (EngineStatus,)) if value is not None else None
            if status is not None and status.model_name:
                engines[sid] = status
        self.engines, self.sent_since_refresh = engines, {}
        now = time.monotonic()
        self.unbound_since = {sid: self.unbound_since.get(sid, now) for sid, e in engines.items() if not e.executor_id}
        if engines:
            self.model_info = next(iter(engines.values()))
        self.down_reason = None if engines else "no engine is running (no scheduler with an executor is alive)"
        if self.resync_why is not None:  # after the reads above: a failed refresh leaves it for the next
            await self._sync_all(self.resync_why)
            self.resync_why = None

    async def _sync_all(self, why: str) -> None:
        """Ask the engines to resend what each request in flight misses (``unknown``: it migrates)."""
        logger.warning("%s: asking the engines to resend what %d requests are missing", why, len(self.requests))
        await asyncio.gather(*(self._sync(h) for h in list(self.requests.values()) if not h.done and h.unrouted_since is None))

    async def _check_routes(self) -> None:
        """Migrate each request that must leave its engine (`reason_to_leave`)."""
        now = time.monotonic()
        for handle in list(self.requests.values()):
            sid = handle.scheduler_id
            why = (
                "waiting for a live engine"
                if handle.unrouted_since is not None
                else reason_to_leave(
                    sid,
                    handle.incarnation,
                    self.engines,
                    now - self.unbound_since.get(sid, now),
                    gone=now > self.settle_until,
                    stranded_after_s=2 * self.heartbeat_ttl_ms / 1000,
                )
            )
            if why is not None and not handle.done and not handle.journal_writes:
                await self._migrate(handle, why)

    async def _keep_journals(self) -> None:
        """A journal lives the resume window past its last write: one this gateway serves but has not
        written for a quarter of that (waiting for an engine, a long queue) must not expire under it."""
        now, idle_s = time.monotonic(), self.journal_ttl_ms / 4000
        idle = [h for h in self.requests.values() if h.journal_id and not h.done and now - h.journaled_at > idle_s]
        if idle:
            await self.transport.refresh_ttl(sorted({self.names.journal(h.journal_id) for h in idle}), self.journal_ttl_ms, 2)
            for handle in idle:
                handle.journaled_at = now

    async def _watch(self) -> None:
        overslept = 0.0
        while True:
            try:
                if overslept > self.heartbeat_ttl_ms / 1000:
                    # Frozen (SIGSTOP, a paused VM) for a heartbeat's life: schedulers may have aborted its
                    # requests or ended orphans, telling it nothing. A sync (in `_refresh`) finds each.
                    self.resync_why = f"this gateway did not run for {overslept:.1f} s"
                await self._refresh()
                read = self._outputs_cursors.get(self.outputs_stream)
                if read is not None:  # this gateway is the stream's only reader (a failed trim: the next redoes it)
                    with contextlib.suppress(*REDIS_FAILURES):
                        await self.transport.trim_through(self.outputs_stream, read)
                await self._resend_owed()
                await self._check_routes()
                await self._keep_journals()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.down_reason = f"cannot reach Redis: {exc}"
                logger.warning("engine watch: %s", exc)
            asleep = time.monotonic()
            await asyncio.sleep(ServiceDefaults.liveness_check_s)
            overslept = time.monotonic() - asleep - ServiceDefaults.liveness_check_s
