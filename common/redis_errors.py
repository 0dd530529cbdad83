"""What a Redis failure means to a service, and how a call retries it (`Backoff`).

Out of reach (a restart, a failover, a network fault) and refusing writes for a while (out of
memory, a read-only replica, a failing disk: `WritesRefused`) are transient: retried with capped
exponential backoff, forever in a service's loops, until a deadline on fail-fast paths; a Redis
restart costs a pause, not a crashed service. Wrong credentials are not: `RedisAuthFailed` at once,
with a message that says so.
"""

from __future__ import annotations

import logging
import time

import redis
from redis.exceptions import AuthenticationError, RedisClusterException, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redis_url import PASSWORD_ENV

logger = logging.getLogger(__name__)

# A cluster's slots not all served (a master lost, its replica not yet promoted) is an outage too.
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, SlotNotCoveredError)
# Redis could not do what was asked: out of reach or refusing writes (TRANSIENT_ERRORS, retried
# until a deadline), or another error of Redis's. A caller that cannot go on without Redis answers
# these as 503, never as its own fault.
REDIS_FAILURES = (redis.RedisError, ConnectionError, OSError)
# Refusals that say what state the server is in (out of memory, a read-only replica, a failing
# disk, a master lost): they pass, as an outage does (`WritesRefused`).
# A cluster that is failing over (CLUSTERDOWN, TRYAGAIN) or has moved a slot (MOVED, ASK, to a
# client whose slot map is stale) passes too.
_REFUSAL_ERRORS = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    redis.exceptions.AskError,
)
# What redis-py's cluster client raises when no node it knows answers (not a RedisError).
_CLUSTER_UNREACHABLE = "Redis Cluster cannot be connected"
_REFUSAL_CODES = ("MISCONF", "BUSY", "NOREPLICAS", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK")


class WritesRefused(RedisConnectionError):
    """Redis refuses writes for now (`refuses_writes`): handled, and retried, as an outage is; a
    service stopped by one would lose what it holds for want of a second's patience."""


def refuses_writes(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing writes in a state that passes (see `WritesRefused`)."""
    if isinstance(exc, _REFUSAL_ERRORS):
        return True
    if isinstance(exc, RedisClusterException) and str(exc).startswith(_CLUSTER_UNREACHABLE):
        return True
    # A pipeline's error names its command first: "Command # 1 (...) of pipeline caused error: MISCONF ...",
    # or (redis-py's async pipeline) the error's args: "... caused error: ('MISCONF ...',)".
    text = str(exc).rpartition("caused error: ")[2].lstrip("('\"")
    return isinstance(exc, redis.ResponseError) and text.startswith(_REFUSAL_CODES)


def as_transient(exc: BaseException) -> BaseException:
    """``exc``, or a `WritesRefused` for a refusal (so that TRANSIENT_ERRORS handlers take it)."""
    return WritesRefused(str(exc)) if refuses_writes(exc) else exc


# What a call catches to hand to `Backoff.wait_s`, which retries the transient ones and re-raises the rest.
RETRIED_ERRORS = (*TRANSIENT_ERRORS, redis.ResponseError, redis.exceptions.ClusterError, RedisClusterException)


class RedisAuthFailed(RuntimeError):
    """Redis refused our credentials: retrying cannot help, so the process says so and stops."""


class Backoff:
    """The retry policy of one `call`: exponential waits from 50 ms, capped at 2 s, until ``deadline_s``
    (None: forever) has passed; wrong credentials raise `RedisAuthFailed` at once."""

    def __init__(self, owner: str, deadline_s: float | None) -> None:
        self.owner, self.deadline_s, self.start, self.delay = owner, deadline_s, time.monotonic(), 0.05

    def wait_s(self, exc: BaseException) -> float:
        """How long to wait before retrying after ``exc``; re-raises it past the deadline, or at
        once when it is no transient error (a refusal is raised as `WritesRefused`)."""
        if not isinstance(exc, TRANSIENT_ERRORS) and not refuses_writes(exc):
            raise exc
        exc = as_transient(exc)
        if isinstance(exc, AuthenticationError):  # a ConnectionError to redis-py, but never transient
            raise RedisAuthFailed(
                f"{self.owner}: Redis rejected the credentials ({exc}); check CONVEYOR_REDIS_URL and {PASSWORD_ENV}[_FILE]"
            ) from None
        if self.deadline_s is not None and time.monotonic() - self.start + self.delay > self.deadline_s:
            raise exc
        logger.warning("%s: redis unavailable (%s); retrying in %.2fs", self.owner, exc, self.delay)
        delay, self.delay = self.delay, min(self.delay * 2, 2.0)
        return delay
