"""`Heartbeat`: a process's liveness key, refreshed on a thread of its own while the process's
working thread turns (`common.watchdog`).

Gateways and executors beat ``hb:<kind>:<id>``; the scheduler's `scheduler.engine_status.EngineBeat`
beats ``engine:<id>`` with its status as the value (it overrides `beat` and `withdraw`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TypeVar

from common.protocol import Names
from common.redis_errors import TRANSIENT_ERRORS, refuses_writes
from common.redis_url import sync_client
from common.watchdog import Watchdog

logger = logging.getLogger(__name__)
_Beat = TypeVar("_Beat", bound="Heartbeat")


class Heartbeat:
    """Refreshes ``key`` every ``interval_s`` (and at once when poked) on a daemon thread with its
    own client.

    The first beat happens in `start` (so the process is visible before it serves); later
    failures are logged and retried at the next tick, never fatal. With a ``watchdog``, a stall of
    the thread it watches withdraws the key and ends the process (`Watchdog.check`).
    """

    def __init__(
        self,
        url: str,
        names: Names,
        kind: str,
        process_id: str,
        interval_s: float,
        ttl_ms: int,
        watchdog: Watchdog | None = None,
        *,
        key: str | None = None,
    ) -> None:
        self.names = names
        self.key = key if key is not None else names.heartbeat(kind, process_id)
        self.interval_s = interval_s
        self.ttl_ms = ttl_ms
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.check_interval(interval_s)
        # Its own client with short timeouts: a beat must not wait behind, or outlive, the service's calls.
        self.redis = sync_client(url, socket_timeout=max(1.0, ttl_ms / 1000), socket_connect_timeout=2.0)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{kind}", daemon=True)

    def beat(self) -> None:
        """Refresh the key once (its TTL is ``ttl_ms``)."""
        self.redis.set(self.key, str(time.time()), px=self.ttl_ms)

    def withdraw(self) -> None:
        """Delete the key now: peers see this process gone without waiting for the TTL. After
        `stop` with a wait: a beat under way would write it again."""
        self.redis.delete(self.key)

    def poke(self) -> None:
        """Beat soon (what the key says changed in a way a reader is waiting for)."""
        self._wake.set()

    def start(self: _Beat) -> _Beat:
        """Beat once now, then on the thread; returns self."""
        try:
            self.beat()
        except TRANSIENT_ERRORS as exc:
            logger.warning("first heartbeat of %s failed: %s", self.key, exc)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop beating; with ``wait_s``, wait that long for a beat under way to finish."""
        self._stop.set()
        self._wake.set()
        if wait_s > 0 and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait_s)
            if self._thread.is_alive():
                logger.warning("a beat of %s still under way after %.0f s: it may write the key once more", self.key, wait_s)

    def _run(self) -> None:
        failed = False
        while True:
            # After a failure, pokes wait for the next tick: Redis is in trouble, and a stream of
            # pokes must not turn the retries into a busy loop.
            (self._stop if failed else self._wake).wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            reachable, failed = True, False
            try:
                self.beat()
            except Exception as exc:  # keep beating whatever happens; the loop is the liveness signal
                reachable = not (isinstance(exc, TRANSIENT_ERRORS) or refuses_writes(exc))  # Redis's trouble, not a stall
                failed = True
                logger.warning("heartbeat %s failed: %s", self.key, exc)
            if self.watchdog is not None:
                self.watchdog.check(self.withdraw, self.interval_s, reachable)
