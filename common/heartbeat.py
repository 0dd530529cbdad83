"""`Heartbeat`: a process's liveness key (``hb:<kind>:<id>``), refreshed on a thread of its own
while the process's working thread turns (`common.watchdog`)."""

from __future__ import annotations

import logging
import threading
import time

from common.protocol import Names
from common.redis_errors import TRANSIENT_ERRORS, refuses_writes
from common.redis_url import sync_client
from common.watchdog import Watchdog

logger = logging.getLogger(__name__)


class Heartbeat:
    """Refreshes ``hb:<kind>:<id>`` every ``interval_s`` on a daemon thread with its own client.

    The first beat happens in `start` (so the process is visible before it serves); later
    failures are logged and retried at the next tick, never fatal. With a ``watchdog``, a stall of
    the thread it watches deletes the key and ends the process (`Watchdog.check`).
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
    ) -> None:
        self.key = names.heartbeat(kind, process_id)
        self.interval_s = interval_s
        self.ttl_ms = ttl_ms
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.check_interval(interval_s)
        # Its own client with short timeouts: a beat must not wait behind, or outlive, the service's calls.
        self.redis = sync_client(url, socket_timeout=max(1.0, ttl_ms / 1000), socket_connect_timeout=2.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{kind}", daemon=True)

    def beat(self) -> None:
        """Refresh the key once (its TTL is ``ttl_ms``)."""
        self.redis.set(self.key, str(time.time()), px=self.ttl_ms)

    def withdraw(self) -> None:
        """Delete the key now: peers see this process gone without waiting for the TTL."""
        self.redis.delete(self.key)

    def start(self) -> Heartbeat:
        """Beat once now, then on the thread; returns self."""
        try:
            self.beat()
        except TRANSIENT_ERRORS as exc:
            logger.warning("first heartbeat of %s failed: %s", self.key, exc)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop beating; with ``wait_s``, wait that long for an in-flight beat to finish."""
        self._stop.set()
        if wait_s > 0 and self._thread.is_alive():
            self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            reachable = True
            try:
                self.beat()
            except Exception as exc:  # keep beating whatever happens; the loop is the liveness signal
                reachable = not (isinstance(exc, TRANSIENT_ERRORS) or refuses_writes(exc))  # Redis's trouble, not a stall
                logger.warning("heartbeat %s failed: %s", self.key, exc)
            if self.watchdog is not None:
                self.watchdog.check(self.withdraw, self.interval_s, reachable)
