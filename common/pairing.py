"""Claim-based pairing: schedulers and executors started with ``--scheduler-id auto``.

A fixed ``--scheduler-id`` pairs a scheduler with the executor of the same id. Replicas started
from one template (``docker compose up --scale scheduler=2 --scale executor=2``) have no ids to
give, so with ``auto``:

- an executor announces itself in the ``executors:unpaired`` sorted set (score: when, in Redis's
  clock) every
  `ANNOUNCE_INTERVAL_S` while no scheduler holds it, and polls its claim key;
- a scheduler (its id made up at start) takes one announced, live executor with
  ``SET claim:<executor> <scheduler> NX PX ttl``: one owner at a time, whoever races;
- the owner refreshes the claim's TTL on its heartbeat (only while the value is still its own);
  a scheduler that dies stops refreshing, the claim expires, and the executor, seeing no claim,
  announces itself again for another scheduler to take;
- the executor serves the scheduler named in its claim: the streams of that scheduler id.
"""

from __future__ import annotations

from typing import cast

import redis

from common.protocol import Names

AUTO = "auto"  # the --scheduler-id that asks for claim-based pairing
ANNOUNCE_INTERVAL_S = 0.5
# Only the owner may refresh or release: compare and act in one step.
REFRESH_SCRIPT = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
RELEASE_SCRIPT = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Announcements are stamped and aged by the Redis server's clock, not the hosts': replicas on
# machines whose clocks disagree by more than a TTL would otherwise see each other's offers as stale.
_NOW_MS = "local t = redis.call('time') local now = t[1] * 1000 + math.floor(t[2] / 1000) "
# The set expires a claim TTL after the last announcement: its entries are all stale by then.
ANNOUNCE_SCRIPT = _NOW_MS + "redis.call('zadd', KEYS[1], now, ARGV[1]) return redis.call('pexpire', KEYS[1], ARGV[2])"
OFFERED_SCRIPT = (
    _NOW_MS
    + "redis.call('zremrangebyscore', KEYS[1], '-inf', now - tonumber(ARGV[1])) "
    + "return redis.call('zrange', KEYS[1], 0, -1)"
)


class Pairing:
    """The Redis keys and commands of claim-based pairing, on a sync client.

    ``ttl_ms`` is the claim's lifetime without a refresh (the heartbeat TTL): how long a dead
    scheduler keeps its executor from the others."""

    def __init__(self, client: redis.Redis, names: Names, ttl_ms: int) -> None:
        self.redis = client
        self.names = names
        self.unpaired = names.unpaired_executors
        self.ttl_ms = ttl_ms
        self._refresh = client.register_script(REFRESH_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._announce = client.register_script(ANNOUNCE_SCRIPT)
        self._offered = client.register_script(OFFERED_SCRIPT)

    def claim_key(self, executor_id: str) -> str:
        return self.names.claim(executor_id)

    # -- executor side ---------------------------------------------------------------------------
    def announce(self, executor_id: str) -> None:
        """Offer this executor to the schedulers (again: the score says how recently)."""
        self._announce(keys=[self.unpaired], args=[executor_id, self.ttl_ms])

    def withdraw(self, executor_id: str) -> None:
        """No longer offered (claimed, or stopping)."""
        self.redis.zrem(self.unpaired, executor_id)

    def owner(self, executor_id: str) -> str | None:
        """The scheduler id holding this executor's claim, or None."""
        value = cast("bytes | None", self.redis.get(self.claim_key(executor_id)))
        return value.decode() if value is not None else None

    # -- scheduler side --------------------------------------------------------------------------
    def offered(self) -> list[str]:
        """Executors announced within a claim TTL, longest waiting first (older entries are dropped:
        their executors stopped announcing, so they are claimed or gone)."""
        members = cast(list[bytes], self._offered(keys=[self.unpaired], args=[self.ttl_ms]))
        return [m.decode() for m in members]

    def try_claim(self, executor_id: str, scheduler_id: str) -> bool:
        """Take the executor unless someone holds it (atomic)."""
        return bool(self.redis.set(self.claim_key(executor_id), scheduler_id, nx=True, px=self.ttl_ms))

    def refresh(self, executor_id: str, scheduler_id: str) -> bool:
        """Extend our claim by a TTL; False if it is not ours (expired, or taken since)."""
        return bool(self._refresh(keys=[self.claim_key(executor_id)], args=[scheduler_id, self.ttl_ms]))

    def release(self, executor_id: str, scheduler_id: str) -> bool:
        """Give the executor up now (if the claim is still ours), so another scheduler can take it."""
        return bool(self._release(keys=[self.claim_key(executor_id)], args=[scheduler_id]))
