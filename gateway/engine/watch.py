"""The gateway's watch over the engines: `EngineWatch`, the collaborator of an `EngineClient`
that keeps its view of the engines current and moves requests off engines that are gone.

Every ``liveness_check_s`` it re-reads the live engines and Redis's ``run_id`` (`refresh`), trims
what this gateway read of its outputs stream, asks again for resends it could not ask for, moves
each request whose engine is gone, restarted or without an executor (`check_routes`), and keeps
the journals of the streams it serves alive (`keep_journals`). The recovery this drives is
described in `gateway.engine.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from common.config import ServiceDefaults
from common.protocol import EngineStatus
from common.redis_errors import REDIS_FAILURES
from gateway.engine.handle import RequestHandle
from gateway.engine.routing import reason_to_leave

if TYPE_CHECKING:  # (the client imports this module: it makes its watch)
    from gateway.engine.client import EngineClient

logger = logging.getLogger("conveyor.gateway")


class EngineWatch:
    """Every ``liveness_check_s``, refreshes ``client``'s view of the engines and recovers its
    requests (`run`). It holds no state of its own: what it reads and writes is the client's,
    through a typed reference, so that a renamed field fails in mypy, not at run time."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def sync_each(self, handles: list[RequestHandle]) -> None:
        """`EngineClient.resend` for each of ``handles`` (one Redis call); one that fails is owed (`run`)."""
        results = await asyncio.gather(*(self.client.resend(h) for h in handles if not h.done), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("could not ask for %d resends (%s); asking again shortly", len(failed), failed[0])

    async def resend_owed(self) -> None:
        """Ask again for the resends that could not be asked for (`RequestHandle.resend_owed`)."""
        await self.sync_each([h for h in self.client.requests.values() if h.resend_owed and h.unrouted_since is None])

    async def refresh(self) -> None:
        """Re-read the live engines and decide whether this gateway can serve (``down_reason``)."""
        c = self.client
        t, t0 = c.transport, time.perf_counter()
        run_id = await t.run_id(deadline_s=2)
        c.redis_rtt_s = time.perf_counter() - t0  # one round trip (plus retries, if Redis is slow to answer)
        if c.run_id is not None and run_id != c.run_id:  # engines need a beat to re-register
            c.settle_until, c.resync_why = time.monotonic() + c.heartbeat_ttl_ms / 1000, "Redis restarted"
        c.run_id = run_id
        ids = [sid.decode() for sid in await t.call(t.redis.zrange, c.names.engines, 0, -1, deadline_s=2)]
        values = await t.get_many([c.names.engine(sid) for sid in ids], deadline_s=2)
        engines: dict[str, EngineStatus] = {}
        for sid, value in zip(ids, values):
            status = t.decode_value(c.names.engine(sid), value, (EngineStatus,)) if value is not None else None
            if status is not None and status.model_name:
                engines[sid] = status
        c.set_engines(engines)
        now = time.monotonic()
        c.unbound_since = {sid: c.unbound_since.get(sid, now) for sid, e in engines.items() if not e.executor_id}
        if engines:
            c.model_info = next(iter(engines.values()))
        c.down_reason = None if engines else "no engine is running (no scheduler with an executor is alive)"
        if c.resync_why is not None:  # after the reads above: a failed refresh leaves it for the next
            await self.sync_all(c.resync_why)
            c.resync_why = None

    async def sync_all(self, why: str) -> None:
        """Ask the engines to resend what each request in flight misses (``unknown``: it migrates)."""
        logger.warning("%s: asking the engines to resend what %d requests are missing", why, len(self.client.requests))
        await asyncio.gather(
            *(self.client.resend(h) for h in list(self.client.requests.values()) if not h.done and h.unrouted_since is None)
        )

    async def check_routes(self) -> None:
        """Migrate each request that must leave its engine (`reason_to_leave`)."""
        now = time.monotonic()
        for handle in list(self.client.requests.values()):
            sid = handle.scheduler_id
            why = (
                "waiting for a live engine"
                if handle.unrouted_since is not None
                else reason_to_leave(
                    sid,
                    handle.incarnation,
                    self.client.engines,
                    now - self.client.unbound_since.get(sid, now),
                    gone=now > self.client.settle_until,
                    stranded_after_s=2 * self.client.heartbeat_ttl_ms / 1000,
                )
            )
            if why is not None and not handle.done and not handle.journal_writes:
                await self.client.migrate(handle, why)

    async def keep_journals(self) -> None:
        """A journal lives the resume window past its last write: one this gateway serves but has not
        written for a quarter of that (waiting for an engine, a long queue) must not expire under it."""
        now, idle_s = time.monotonic(), self.client.journal_ttl_ms / 4000
        idle = [h for h in self.client.requests.values() if h.journal_id and not h.done and now - h.journaled_at > idle_s]
        if idle:
            await self.client.transport.refresh_ttl(
                sorted({self.client.names.journal(h.journal_id) for h in idle}), self.client.journal_ttl_ms, 2
            )
            for handle in idle:
                handle.journaled_at = now

    async def run(self) -> None:
        overslept = 0.0
        while True:
            try:
                if overslept > self.client.heartbeat_ttl_ms / 1000:
                    # Frozen (SIGSTOP, a paused VM) for a heartbeat's life: schedulers may have aborted its
                    # requests or ended orphans, telling it nothing. A sync (in `refresh`) finds each.
                    self.client.resync_why = f"this gateway did not run for {overslept:.1f} s"
                await self.refresh()
                read = self.client._outputs_cursors.get(self.client.outputs_stream)
                if read is not None:  # this gateway is the stream's only reader (a failed trim: the next redoes it)
                    with contextlib.suppress(*REDIS_FAILURES):
                        await self.client.transport.trim_through(self.client.outputs_stream, read)
                await self.resend_owed()
                await self.check_routes()
                await self.keep_journals()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Clients see that much; the log has the detail (its address is not theirs to know).
                self.client.down_reason = "Redis unreachable"
                logger.warning("engine watch: Redis unreachable: %s", exc)
            asleep = time.monotonic()
            await asyncio.sleep(ServiceDefaults.liveness_check_s)
            overslept = time.monotonic() - asleep - ServiceDefaults.liveness_check_s
