"""`TransportCore.ttls_due`: a key's TTL is renewed once per eighth of it (to the TTL plus that
eighth), not at every write, and at the next write again after an error (Redis may have lost it)."""

from __future__ import annotations

import fakeredis
import pytest
import redis

import common.transport as transport_module
from common.protocol import Names
from common.transport import TTL_RENEW_FRACTION, Outgoing, SyncTransport, renewed_ttl_ms

pytestmark = pytest.mark.unit

TTL_MS = 8_000


class Clock:
    """Stands in for the `time` module in `common.transport`: monotonic time moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> tuple[SyncTransport, Clock]:
    clock = Clock()
    monkeypatch.setattr(transport_module, "time", clock)
    t = SyncTransport("redis://unused", Names("t-ttl"), owner="test")
    t.redis = fakeredis.FakeRedis()
    return t, clock


def test_a_ttl_is_renewed_once_per_eighth_of_it(env: tuple[SyncTransport, Clock]) -> None:
    t, clock = env
    key, r = "t-ttl:a", env[0].redis
    t.exchange([Outgoing(key, b"1", None, TTL_MS), Outgoing(key, b"2", None, TTL_MS)])
    assert TTL_MS < r.pttl(key) <= renewed_ttl_ms(TTL_MS)  # at least the TTL past the write
    r.pexpire(key, 500)  # marks whether the next write renews
    clock.now += 0.9 * TTL_MS / 1000 / TTL_RENEW_FRACTION
    t.exchange([Outgoing(key, b"3", None, TTL_MS)])
    assert r.pttl(key) <= 500  # renewed less than an eighth ago: the TTL still covers this write
    clock.now += 0.2 * TTL_MS / 1000 / TTL_RENEW_FRACTION
    t.exchange([Outgoing(key, b"4", None, TTL_MS)])
    assert r.pttl(key) > TTL_MS
    assert r.xlen(key) == 4
    t.exchange([Outgoing("t-ttl:b", b"1")])  # no TTL asked for: none set
    assert r.pttl("t-ttl:b") == -1


def test_an_error_forgets_what_was_renewed(env: tuple[SyncTransport, Clock]) -> None:
    t, _ = env
    key, r = "t-ttl:a", t.redis
    t.exchange([Outgoing(key, b"1", None, TTL_MS)])
    r.delete(key)  # as a Redis restart loses it
    failures = [redis.ConnectionError("Redis restarting")]

    def flaky() -> None:
        if failures:
            raise failures.pop()

    t.call(flaky)  # retried: the next write renews whatever it was renewed before
    t.exchange([Outgoing(key, b"2", None, TTL_MS)])
    assert TTL_MS < r.pttl(key) <= renewed_ttl_ms(TTL_MS)


def test_renewals_are_pruned_once_lapsed(env: tuple[SyncTransport, Clock]) -> None:
    t, clock = env
    sends = [Outgoing(f"k{i}", b"", None, TTL_MS) for i in range(transport_module.RENEWALS_PRUNE_SIZE + 1)]
    assert t.ttls_due(sends) == [renewed_ttl_ms(TTL_MS)] * len(sends)
    assert len(t._renew_at) == len(sends)  # none lapsed yet: all kept, the next prune at twice as many
    clock.now += TTL_MS / 1000
    fresh = [Outgoing(f"f{i}", b"", None, TTL_MS) for i in range(len(sends) + 5)]
    t.ttls_due(fresh)
    assert sorted(t._renew_at) == sorted(send.stream for send in fresh)
