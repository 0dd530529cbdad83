"""`Watchdog`: whether a service's working thread still turns, checked by its heartbeat.

A liveness key refreshed by a thread of its own says that a process exists, not that it works. A
scheduler whose engine thread is stuck (a deadlock, an endless loop, a call that never returns),
an executor stuck in a forward pass (a hung device) or a gateway whose event loop is blocked would
keep its work forever while every peer saw it alive, and nothing would recover that work. So the
working thread ticks a `Watchdog` on every turn of its loop (every wait in it is bounded), and the
heartbeat thread checks it before each beat. Once it has not turned for ``limit_s``, the heartbeat
thread writes every thread's stack to the log (where the thread is stuck), takes the process's
liveness keys out of Redis so that its peers recover its work at once, as after a crash, and ends
the process with `STALLED_EXIT_CODE`: a thread that is stuck cannot be trusted to resume sanely,
and its supervisor (compose, Kubernetes) starts a fresh one, as a failed liveness probe would.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

logger = logging.getLogger(__name__)

# Distinct from a crash (1) and from a signal (128 + n), so a supervisor's log says which it was.
STALLED_EXIT_CODE = 70


class Watchdog:
    """Ticked by the working thread (or event loop); `stalled_for` says how long it has not turned,
    once that exceeds ``limit_s``. Unarmed (never stalled) until its first tick, so that loading a
    model before the loop starts is not a stall."""

    def __init__(self, what: str, limit_s: float) -> None:
        if limit_s <= 0:
            raise ValueError(f"the stall timeout must be > 0 seconds, got {limit_s}")
        self.what = what  # e.g. "the engine thread", for the log
        self.limit_s = limit_s
        self.last_tick: float | None = None
        self.last_check: float | None = None

    def tick(self) -> None:
        """The working thread turned (cheap: one clock read)."""
        self.last_tick = time.monotonic()

    def stalled_for(self) -> float | None:
        """Seconds since the last tick if that is more than ``limit_s``, else None."""
        last = self.last_tick
        if last is None:
            return None
        idle = time.monotonic() - last
        return idle if idle > self.limit_s else None

    def excuse(self) -> None:
        """The heartbeat thread cannot reach Redis either: the working thread is waiting for Redis
        (its calls retry until it answers), which is no stall. Counting starts again from now."""
        if self.last_tick is not None:
            self.tick()

    def check(self, withdraw: Callable[[], None]) -> None:
        """From the heartbeat thread, before a beat: if the working thread has stalled, `withdraw`
        (best effort: take this process's keys out of Redis) and end the process.

        A check long after the previous one means the checker did not run either: the whole process
        was frozen (SIGSTOP, a paused VM), which its peers saw as a lapsed heartbeat and handled. The
        working thread then gets a whole ``limit_s`` from now to turn again."""
        now = time.monotonic()
        if self.last_check is not None and now - self.last_check > self.limit_s / 4:
            self.excuse()
        self.last_check = now
        idle = self.stalled_for()
        if idle is not None:
            self.fire(idle, withdraw)

    def fire(self, idle: float, withdraw: Callable[[], None]) -> NoReturn:
        logger.critical(
            "%s has not turned for %.1f s (stall timeout %.0f s): withdrawing and exiting with %d so that "
            "peers recover its work and a supervisor restarts it; every thread's stack follows",
            self.what,
            idle,
            self.limit_s,
            STALLED_EXIT_CODE,
        )
        logger.critical("stacks:\n%s", thread_stacks())  # through logging: one record, in the JSON format too
        try:
            withdraw()
        except Exception as exc:  # the keys then expire with their TTL instead
            logger.warning("could not withdraw: %s", exc)
        for handler in logging.getLogger().handlers:
            handler.flush()
        # os._exit, not sys.exit: the stuck thread would never let an orderly shutdown finish.
        os._exit(STALLED_EXIT_CODE)


def thread_stacks() -> str:
    """Every thread's stack, innermost call last, each under its thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )
