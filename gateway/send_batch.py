"""`SendBatch`: the appends of many tasks of the gateway, sent to Redis in one call.

A burst of requests runs its handlers back to back on the event loop, and each one made its own
round trip (one script call) for its request and its journal's first entries; after a Redis
restart every stream asked for a resend in turn. Calls made while a batch waits to leave join it
instead: one call for the whole burst, its appends in the order the calls were made (so each
caller's own appends stay in order), and every caller gets that call's outcome, or its error. A
lone call waits for one turn of the event loop; a batch leaves after the tasks that were ready
before it, which is when the burst's last request is in it.

A caller cancelled before its batch leaves (its client went away) sends nothing: an engine then
never starts a request that nobody reads.
"""

from __future__ import annotations

import asyncio

from common.transport import Outgoing, Transport


class SendBatch:
    """Coalesces `Transport.send_many` calls of one event loop; ``deadline_s`` bounds each batch
    (Redis away that long: every caller in it gets the error)."""

    def __init__(self, transport: Transport, deadline_s: float) -> None:
        self.transport = transport
        self.deadline_s = deadline_s
        self._waiting: list[tuple[list[Outgoing], asyncio.Future[None]]] = []
        self._leaving: set[asyncio.Task[None]] = set()  # batches on their way (a reference keeps each alive)
        self.num_calls = 0  # round trips made, for tests and benchmarks

    async def send(self, sends: list[Outgoing]) -> None:
        """Append ``sends`` with the next batch; returns once it is in Redis."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._waiting:  # the first of a batch: it leaves after the tasks ready now
            task = asyncio.create_task(self._flush())
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        self._waiting.append((sends, future))
        await future

    async def _flush(self) -> None:
        batch, self._waiting = self._waiting, []
        batch = [(sends, future) for sends, future in batch if not future.done()]  # cancelled: not sent
        if not batch:
            return
        try:
            self.num_calls += 1
            await self.transport.send_many([out for sends, _ in batch for out in sends], deadline_s=self.deadline_s)
        except BaseException as exc:  # cancelled too (the gateway stops): no caller may wait for good
            for _, future in batch:
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            if not isinstance(exc, Exception):
                raise
        else:
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
