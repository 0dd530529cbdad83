"""The waiting queue, in the order its requests are admitted (vLLM's two scheduling policies).

``fcfs``: by arrival, and a preempted request goes back to the front. ``priority``: by
``(priority, arrival_time)``, lower first (vLLM's), a preempted request included (it keeps its
place among its peers: it arrived before those that came after it). Either way the scheduler
admits from the front and stops at the first request it cannot admit (a held sibling, or one
still in a step in flight, is passed over).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from common.config import SCHEDULING_POLICIES
from scheduler.request import Request


class WaitingQueue:
    """Waiting requests in admission order (see the module docstring)."""

    __slots__ = ("by_priority", "queue")

    def __init__(self, policy: str) -> None:
        assert policy in SCHEDULING_POLICIES, policy
        self.by_priority = policy == "priority"
        self.queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """A request that just arrived."""
        if self.by_priority:
            self._insert(request)
        else:
            self.queue.append(request)

    def requeue(self, request: Request) -> None:
        """A preempted request: first (fcfs), or in its place (priority)."""
        if self.by_priority:
            self._insert(request)
        else:
            self.queue.appendleft(request)

    def _insert(self, request: Request) -> None:
        at = bisect.bisect_right(self.queue, admission_key(request), key=admission_key)  # after its equals: they came first
        self.queue.insert(at, request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out, wherever it is (found by identity: `Request` has no ``==`` of its own)."""
        self.queue.remove(request)

    def __delitem__(self, index: int) -> None:
        del self.queue[index]

    def __getitem__(self, index: int) -> Request:
        return self.queue[index]

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)


def admission_key(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival_time


def pick_victim(running: list[Request], by_priority: bool, spare: Request | None = None) -> Request:
    """The running request to preempt when blocks run out: the last admitted (fcfs), or the lowest
    priority, latest arrival (priority; vLLM's); never ``spare``."""
    if not by_priority:
        return next(r for r in reversed(running) if r is not spare)
    return max((r for r in running if r is not spare), key=admission_key)
