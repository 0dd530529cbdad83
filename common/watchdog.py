"""`Watchdog`: whether a service's working thread still turns, checked by its heartbeat.

A liveness key refreshed by a thread of its own says that a process exists, not that it works. A
scheduler whose engine thread is stuck (a deadlock, an endless loop, a call that never returns),
an executor stuck in a forward pass (a hung device) or a gateway whose event loop is blocked would
keep its work forever while every peer saw it alive, and nothing would recover that work. So the
working thread ticks a `Watchdog` on every turn of its loop (every wait in it is bounded), and the
heartbeat thread checks it after each beat. Once it has not turned for ``limit_s``, the heartbeat
thread takes the process's liveness key out of Redis, so that its peers recover its work at once
as after a crash, logs every thread's stack (where the thread is stuck) and ends the process with
`STALLED_EXIT_CODE`: a thread that is stuck cannot be trusted to resume sanely, and a supervisor
(compose, Kubernetes) starts a fresh process, as after a failed liveness probe.

Time the checker cannot judge does not count: while Redis is unreachable (the working thread is
then waiting in Redis retries, and exiting would only turn an outage into restarts), and while the
checker itself did not run (the whole process was frozen: SIGSTOP, a paused VM; its peers saw the
heartbeat lapse and recovered already). A thread stuck while holding the GIL stops the checker
too: its beats stop, so peers recover its work at the TTL, but the process stays.
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
# A check later than twice the beat interval plus this means the checker was frozen too.
FREEZE_SLACK_S = 1.0
# Whatever blocks the way out (a log handler stuck on a full pipe), the process ends this soon.
EXIT_GRACE_S = 5.0


class Watchdog:
    """Ticked by the working thread (or event loop); checked by the heartbeat thread (`check`).
    Unarmed until the first tick, so that loading a model before the loop starts is no stall."""

    def __init__(self, what: str, limit_s: float) -> None:
        if not limit_s > 0:
            raise ValueError(f"the stall timeout must be > 0 seconds, got {limit_s}")
        self.what = what  # e.g. "the engine thread", for the log
        self.limit_s = limit_s
        self.last_tick: float | None = None
        self.excused_s = 0.0  # of the time since the last tick, what the checker could not judge
        self.last_check: float | None = None
        self.last_reachable = True

    def tick(self) -> None:
        """The working thread turned (cheap: one clock read)."""
        self.last_tick = time.monotonic()
        self.excused_s = 0.0

    def check_interval(self, interval_s: float) -> None:
        """``ValueError`` unless a stall can be told from a late check at this beat interval."""
        if not self.limit_s > freeze_after_s(interval_s):
            raise ValueError(
                f"the stall timeout ({self.limit_s:g} s) must be longer than twice the heartbeat interval plus "
                f"{FREEZE_SLACK_S:g} s ({freeze_after_s(interval_s):g} s): raise it or shorten the heartbeat TTL"
            )

    def stalled_for(self) -> float | None:
        """How long the working thread has not turned, not counting excused time, if that is more
        than ``limit_s``; else None."""
        last = self.last_tick
        if last is None:
            return None
        idle = time.monotonic() - last - self.excused_s
        return idle if idle > self.limit_s else None

    def check(self, withdraw: Callable[[], None], interval_s: float, reachable: bool = True) -> None:
        """From the heartbeat thread, after each beat (``reachable``: whether it reached Redis):
        if the working thread has stalled, `withdraw` (take the liveness key out of Redis) and end
        the process. The time since the previous check is excused when Redis was unreachable at
        either end of it, or when this check comes late (the checker was frozen too)."""
        now = time.monotonic()
        last_tick, last_check = self.last_tick, self.last_check
        if last_tick is not None and last_check is not None:
            frozen = now - last_check > freeze_after_s(interval_s)
            if frozen or not reachable or not self.last_reachable:
                self.excused_s += max(0.0, now - max(last_check, last_tick))
        self.last_check, self.last_reachable = now, reachable
        idle = self.stalled_for()
        if idle is not None:
            self.fire(idle, withdraw)

    def fire(self, idle: float, withdraw: Callable[[], None]) -> NoReturn:
        """Withdraw, log the stacks, exit with `STALLED_EXIT_CODE` (within `EXIT_GRACE_S` whatever blocks)."""
        threading.Thread(target=_exit_after, args=(EXIT_GRACE_S,), name="watchdog-exit", daemon=True).start()
        try:
            withdraw()
        except Exception as exc:  # the key then expires with its TTL instead
            logger.warning("could not withdraw: %s", exc)
        logger.critical(
            "%s has not turned for %.1f s (stall timeout %g s): withdrawn; exiting with %d for a supervisor to "
            "restart this process. Every thread's stack:\n%s",
            self.what,
            idle,
            self.limit_s,
            STALLED_EXIT_CODE,
            thread_stacks(),
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        # os._exit, not sys.exit: the stuck thread would never let an orderly shutdown finish.
        os._exit(STALLED_EXIT_CODE)


def freeze_after_s(interval_s: float) -> float:
    """A check this long after the previous one means the checker did not run either."""
    return 2 * interval_s + FREEZE_SLACK_S


def thread_stacks() -> str:
    """Every thread's stack, innermost call last, each under its thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(STALLED_EXIT_CODE)
