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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.heartbeat import Heartbeat
from common.protocol import ENGINE_FORGET_S, EngineStatus, ExecutorHello, Names, encode
from common.transport import server_run_id
from common.watchdog import Watchdog

if TYPE_CHECKING:
    from scheduler.service import SchedulerService

logger = logging.getLogger(__name__)


class EngineBeat(Heartbeat):
    """The scheduler's `Heartbeat`: ``engine:<id>`` holds ``snapshot()`` (TTL), and the ``engines``
    set lists the scheduler. Each beat also checks Redis's ``run_id`` and calls
    ``on_redis_restart`` when it changed."""

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
        super().__init__(url, names, "scheduler", scheduler_id, interval_s, ttl_ms, watchdog, key=names.engine(scheduler_id))
        self.scheduler_id = scheduler_id
        self.snapshot = snapshot
        self.on_redis_restart = on_redis_restart
        self.run_id: str | None = None

    def beat(self) -> None:
        """Publish the status once; first call `on_redis_restart` if Redis restarted since the last beat."""
        now = time.time()
        run_id = server_run_id(self.redis)
        if self.run_id is not None and run_id != self.run_id:
            logger.warning("Redis restarted (run_id %s -> %s): re-registering", self.run_id[:8], run_id[:8])
            self.on_redis_restart()
        self.run_id = run_id
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.key, encode(self.snapshot()), px=self.ttl_ms)
        pipe.zadd(self.names.engines, {self.scheduler_id: now})
        pipe.zremrangebyscore(self.names.engines, "-inf", now - ENGINE_FORGET_S)
        pipe.pexpire(self.names.engines, int(ENGINE_FORGET_S * 1000))  # gone when every scheduler is
        pipe.execute()

    def withdraw(self) -> None:
        """Take this engine out of Redis now (its status key and its place in ``engines``), rather
        than at the TTL: gateways migrate its requests at once."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.key)
        pipe.zrem(self.names.engines, self.scheduler_id)
        pipe.execute()


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
        cached_prefixes=engine.cache.summary.encode() if engine else b"",
    )
