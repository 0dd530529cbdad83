"""`AbortQueue`: the engine requests this gateway wants stopped, sent in batches.

Aborts are queued without an await (a cancelled task, a client that went away, may queue one) and
leave together, one `AbortRequests` per engine, from one background task: a burst of disconnects
costs one Redis round trip, not one each.

A client that hangs up and resumes its stream on this same gateway makes the abort stale: the
engine cannot tell it from a later one by its gateway. `withdraw` therefore drops it if it is still
queued, or waits until it is in the engine's stream, so that it always precedes the resume's
`SyncRequest` there (the scheduler drops an abort that a sync from its gateway follows).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from common.protocol import AbortRequests
from common.transport import Outgoing, Transport

logger = logging.getLogger("conveyor.gateway")


class AbortQueue:
    """Engine request ids to stop, by scheduler id; ``to_engine`` makes a message for an engine's
    requests stream."""

    def __init__(self, transport: Transport, gateway_id: str, to_engine: Callable[[str, Any], Outgoing]) -> None:
        self.transport = transport
        self.gateway_id = gateway_id
        self.to_engine = to_engine
        self.pending: dict[str, list[str]] = {}
        self._event = asyncio.Event()
        self._sending: list[tuple[set[str], asyncio.Event]] = []  # batches on their way: ids, set when sent

    def add(self, scheduler_id: str, engine_request_id: str) -> None:
        """Queue one (no await); it leaves with the next batch."""
        self.pending.setdefault(scheduler_id, []).append(engine_request_id)
        self._event.set()

    async def run(self) -> None:
        """Send batches as aborts are queued (a background task)."""
        while True:
            await self._event.wait()
            self._event.clear()
            await self.flush("client")

    async def flush(self, reason: str, deadline_s: float | None = None) -> None:
        """Send what is queued now; a failure is logged (the engine ends such requests by itself)."""
        aborts, self.pending = self.pending, {}
        sends = [self.to_engine(sid, AbortRequests(ids, reason, self.gateway_id)) for sid, ids in aborts.items() if sid]
        batch = ({r for ids in aborts.values() for r in ids}, asyncio.Event())
        self._sending.append(batch)
        try:
            await self.transport.send_many(sends, deadline_s=deadline_s)
        except Exception:
            logger.exception("could not send aborts")
        finally:
            self._sending.remove(batch)
            batch[1].set()

    async def withdraw(self, scheduler_id: str, engine_request_id: str, deadline_s: float) -> bool:
        """This gateway takes the request up again (its client resumes the stream here): a queued
        abort of it is dropped (True); one on its way is waited for (see the module docstring), for
        at most ``deadline_s`` (Redis away that long: `asyncio.TimeoutError`, and the resume fails,
        as its sync would)."""
        queued = self.pending.get(scheduler_id, [])
        dropped = engine_request_id in queued
        if dropped:
            self.pending[scheduler_id] = [r for r in queued if r != engine_request_id]
        for ids, sent in list(self._sending):
            if engine_request_id in ids:
                await asyncio.wait_for(sent.wait(), deadline_s)
        return dropped
