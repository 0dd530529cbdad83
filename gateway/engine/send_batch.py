"""`SendBatch`: the appends of many tasks of the gateway, sent to Redis in one call.

A burst of requests runs its handlers back to back on the event loop, and each one made its own
round trip (one script call) for its request and its journal's first entries; after a Redis
restart every stream asked for a resend in turn. Calls made while a batch waits to leave join it
instead: one call for the whole burst, its appends in the order the calls were made (so each
caller's own appends stay in order), and every caller gets that call's outcome, or its error. A
lone call waits for one turn of the event loop; a batch leaves after the tasks that were ready
before it, which is when the burst's last request is in it.

A caller cancelled before its batch leaves (its client went away) sends nothing: an engine then
never starts a request that nobody reads. A batch holds at most `MAX_BATCH_BYTES` (a burst of
long prompts leaves in several calls: one script call must neither exceed what Redis takes as one
argument nor hold Redis up for long), and a batch that cannot leave (the gateway stops) fails its
callers with an error instead of leaving them waiting.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

from common.transport import Outgoing, Transport

MAX_BATCH_BYTES = 4 << 20  # a batch's payload; a larger single call leaves alone


@dataclass(slots=True)
class _Batch:
    calls: list[tuple[list[Outgoing], asyncio.Future[None]]] = field(default_factory=list)
    num_bytes: int = 0


class SendBatch:
    """Coalesces `Transport.send_many` calls of one event loop; ``deadline_s`` bounds each batch
    (Redis away that long: every caller in it gets the error)."""

    def __init__(self, transport: Transport, deadline_s: float) -> None:
        self.transport = transport
        self.deadline_s = deadline_s
        self._open: _Batch | None = None  # the batch that calls join; it leaves with its task
        self._leaving: set[asyncio.Task[None]] = set()  # a reference keeps each batch's task alive
        self.num_calls = 0  # round trips made, for tests and benchmarks

    async def send(self, sends: list[Outgoing]) -> None:
        """Append ``sends`` with the next batch; returns once it is in Redis."""
        size = sum(len(out.data) for out in sends)
        batch = self._open
        if batch is None or batch.num_bytes + size > MAX_BATCH_BYTES:
            # A new batch leaves after the tasks ready now (those of the burst this call is part of).
            batch = self._open = _Batch()
            task = asyncio.create_task(self._flush(batch))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
            task.add_done_callback(functools.partial(self._closed, batch))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch.calls.append((sends, future))
        batch.num_bytes += size
        await future

    def _closed(self, batch: _Batch, _task: asyncio.Task[None]) -> None:
        # Its task ended, even one cancelled before it ran: later calls start a new batch, and no
        # caller of this one waits for good.
        if self._open is batch:
            self._open = None
        for _, future in batch.calls:
            if not future.done():
                future.set_exception(ConnectionError("the gateway stopped before this send left"))

    async def _flush(self, batch: _Batch) -> None:
        if self._open is batch:
            self._open = None
        calls = [(sends, future) for sends, future in batch.calls if not future.done()]  # cancelled: not sent
        if not calls:
            return
        try:
            self.num_calls += 1
            await self.transport.send_many([out for sends, _ in calls for out in sends], deadline_s=self.deadline_s)
        except Exception as exc:
            for _, future in calls:
                if not future.done():
                    future.set_exception(exc)
        else:
            for _, future in calls:
                if not future.done():
                    future.set_result(None)
