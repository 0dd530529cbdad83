"""`EngineBeat`: the scheduler's heartbeat, which also publishes its `EngineStatus`.

Gateways route by it (which engines are alive, their model, their load) and detect a restarted
scheduler by its ``incarnation``. It beats on its own thread (a long step must not let it lapse),
every interval and at once when poked (after aborts, so freed blocks show without delay); a
stalled engine thread ends it, and the process (`common.watchdog`). It also watches Redis's
``run_id``: a new one means Redis restarted and lost what it held, and the scheduler must
re-create its side (it rebinds its executor; the key itself is rewritten here). What it
publishes is read off the scheduler service by `engine_status`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.protocol import ENGINE_FORGET_S, EngineStatus, ExecutorHello, Names, encode
from common.redis_errors import TRANSIENT_ERRORS, refuses_writes
from common.redis_url import sync_client
from common.transport import CLIENT_OPTIONS, server_run_id
from common.watchdog import Watchdog

if TYPE_CHECKING:
    from scheduler.service import SchedulerService

logger = logging.getLogger(__name__)


class EngineBeat:
    """Writes ``engine:<id>`` (TTL) and the ``engines`` set from ``snapshot()`` on a daemon thread."""

    def __init__(
        self,
        url: str,
        names: Names,
        scheduler_id: str,
        interval_s: float,
        ttl_ms: int,
        snapshot: Callable[[], EngineStatus],
        on_redis_restart: Callable[[], None],
        watchdog: Watchdog | None = None,
    ) -> None:
        self.names = names
        self.scheduler_id = scheduler_id
        self.interval_s = interval_s
        self.ttl_ms = ttl_ms
        self.snapshot = snapshot
        self.on_redis_restart = on_redis_restart
        self.watchdog = watchdog  # of the engine thread: its stall withdraws the engine and ends the process
        if watchdog is not None:
            watchdog.check_interval(interval_s)
        self.redis = sync_client(url, **{**CLIENT_OPTIONS, "socket_timeout": max(1.0, ttl_ms / 1000)})
        self.run_id: str | None = None
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-beat", daemon=True)

    def beat(self) -> None:
        now = time.time()
        run_id = server_run_id(self.redis)
        if self.run_id is not None and run_id != self.run_id:
            logger.warning("Redis restarted (run_id %s -> %s): re-registering", self.run_id[:8], run_id[:8])
            self.on_redis_restart()
        self.run_id = run_id
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.names.engine(self.scheduler_id), encode(self.snapshot()), px=self.ttl_ms)
        pipe.zadd(self.names.engines, {self.scheduler_id: now})
        pipe.zremrangebyscore(self.names.engines, "-inf", now - ENGINE_FORGET_S)
        pipe.pexpire(self.names.engines, int(ENGINE_FORGET_S * 1000))  # gone when every scheduler is
        pipe.execute()

    def remove(self) -> None:
        """Take this engine out of Redis now (its status key and its place in ``engines``), rather
        than at the TTL: gateways migrate its requests at once. After `stop` with a wait: a beat
        under way would publish the engine again."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.names.engine(self.scheduler_id))
        pipe.zrem(self.names.engines, self.scheduler_id)
        pipe.execute()

    def poke(self) -> None:
        """Publish soon (the load changed in a way a reader is waiting for)."""
        self._poke.set()

    def start(self) -> EngineBeat:
        self.beat()  # visible before serving; a failure here (Redis down, bad password) is fatal
        self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Beat no more; wait up to ``wait_s`` for a beat under way to end."""
        self._stop.set()
        self._poke.set()
        if wait_s > 0 and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)
            if self._thread.is_alive():
                logger.warning("a beat still under way after %.0f s: it may publish this engine once more", wait_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self.interval_s)
            self._poke.clear()
            if self._stop.is_set():
                break
            reachable = True
            try:
                self.beat()
            except Exception as exc:  # keep beating whatever happens; Redis may be restarting
                reachable = not (isinstance(exc, TRANSIENT_ERRORS) or refuses_writes(exc))  # Redis's trouble, not a stall
                logger.warning("engine status not published: %s", exc)
                time.sleep(min(self.interval_s, 0.2))
            if self.watchdog is not None:
                self.watchdog.check(self.remove, self.interval_s, reachable)


def engine_status(service: SchedulerService) -> EngineStatus:
    """``service``'s liveness, model and load: what `EngineBeat` publishes."""
    engine, hello, executor = service.engine, service.binding.hello, service.executor
    h = hello if hello is not None else ExecutorHello("", "", "", 0, 0, 0, 0)
    return EngineStatus(
        scheduler_id=service.sid,
        incarnation=service.incarnation,
        model_name=h.model_name,
        model_path=h.model_path,
        max_model_len=h.max_model_len,
        vocab_size=h.vocab_size,
        block_size=h.block_size,
        num_blocks=h.num_blocks,
        executor_id=executor.executor_id if executor else "",
        epoch=service.binding.epoch,
        num_free_blocks=engine.cache.get_num_free_blocks() if engine else 0,
        num_running=len(engine.running) if engine else 0,
        num_waiting=len(engine.waiting) if engine else 0,
        num_steps=engine.num_steps if engine else 0,
        num_preemptions=engine.num_preemptions if engine else 0,
        num_dead_letters=service.transport.num_dead_letters,
        updated_at=time.time(),
        step_wall_s=service.step_wall_s,
        step_forward_s=service.step_forward_s,
        step_count=service.step_count,
        prefix_cache_queries=engine.prefix_cache_queries if engine else 0,
        prefix_cache_hits=engine.prefix_cache_hits if engine else 0,
        scheduling_policy=service.config.scheduling_policy,
    )
