"""`ExecutorClaims`: a scheduler's side of claim-based pairing (`common.protocol`, "Pairing"): it
finds offered executors and takes, keeps and gives up claims on them."""

from __future__ import annotations

from typing import cast

import redis

from common.protocol import REDIS_NOW_MS_LUA, Names

# Only the owner may refresh or release: compare and act in one step.
REFRESH_SCRIPT = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
RELEASE_SCRIPT = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Offers older than a claim TTL are dropped by Redis's clock, the one they were stamped by.
OFFERED_SCRIPT = (
    REDIS_NOW_MS_LUA
    + "redis.call('zremrangebyscore', KEYS[1], '-inf', now - tonumber(ARGV[1])) "
    + "return redis.call('zrange', KEYS[1], 0, -1)"
)


class ExecutorClaims:
    """The Redis commands a scheduler pairs by, on a sync client. ``ttl_ms`` is a claim's lifetime
    without a refresh (the heartbeat TTL): how long a dead scheduler keeps its executor from the others."""

    def __init__(self, client: redis.Redis, names: Names, ttl_ms: int) -> None:
        self.redis = client
        self.names = names
        self.unpaired = names.unpaired_executors
        self.ttl_ms = ttl_ms
        self._refresh = client.register_script(REFRESH_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._offered = client.register_script(OFFERED_SCRIPT)

    def offered(self) -> list[str]:
        """Executors announced within a claim TTL, longest waiting first (older entries are dropped:
        their executors stopped announcing, so they are claimed or gone)."""
        members = cast(list[bytes], self._offered(keys=[self.unpaired], args=[self.ttl_ms]))
        return [m.decode() for m in members]

    def try_claim(self, executor_id: str, scheduler_id: str) -> bool:
        """Take the executor unless someone holds it (atomic)."""
        return bool(self.redis.set(self.names.claim(executor_id), scheduler_id, nx=True, px=self.ttl_ms))

    def refresh(self, executor_id: str, scheduler_id: str) -> bool:
        """Extend our claim by a TTL; False if it is not ours (expired, or taken since)."""
        return bool(self._refresh(keys=[self.names.claim(executor_id)], args=[scheduler_id, self.ttl_ms]))

    def release(self, executor_id: str, scheduler_id: str) -> bool:
        """Give the executor up now (if the claim is still ours), so another scheduler can take it."""
        return bool(self._release(keys=[self.names.claim(executor_id)], args=[scheduler_id]))
