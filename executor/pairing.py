"""`ExecutorOffer`: an executor's side of claim-based pairing (`common.protocol`, "Pairing"):
it offers itself to the schedulers and reads who claimed it."""

from __future__ import annotations

from typing import cast

import redis

from common.protocol import REDIS_NOW_MS_LUA, Names

ANNOUNCE_INTERVAL_S = 0.5  # how often an executor nobody holds offers itself again
# Stamp by Redis's clock; the set expires a claim TTL after the last announcement (its entries are
# all stale by then, and no scheduler may be left to trim it).
ANNOUNCE_SCRIPT = REDIS_NOW_MS_LUA + "redis.call('zadd', KEYS[1], now, ARGV[1]) return redis.call('pexpire', KEYS[1], ARGV[2])"


class ExecutorOffer:
    """The Redis commands an executor pairs by, on a sync client. ``ttl_ms``: a claim's lifetime
    without a refresh (the heartbeat TTL), which is also how long an announcement stays fresh."""

    def __init__(self, client: redis.Redis, names: Names, ttl_ms: int) -> None:
        self.redis = client
        self.names = names
        self.unpaired = names.unpaired_executors
        self.ttl_ms = ttl_ms
        self._announce = client.register_script(ANNOUNCE_SCRIPT)

    def announce(self, executor_id: str) -> None:
        """Offer this executor to the schedulers (again: the score says how recently)."""
        self._announce(keys=[self.unpaired], args=[executor_id, self.ttl_ms])

    def withdraw(self, executor_id: str) -> None:
        """No longer offered (claimed, or stopping)."""
        self.redis.zrem(self.unpaired, executor_id)

    def owner(self, executor_id: str) -> str | None:
        """The scheduler id holding this executor's claim, or None."""
        value = cast("bytes | None", self.redis.get(self.names.claim(executor_id)))
        return value.decode() if value is not None else None
