"""`Watchdog` alone (a fake clock) and with a real `Heartbeat` on the local Redis; the services'
watchdogs against real hung processes are in `tests/test_stalls.py`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import common.watchdog as watchdog_module
from common.heartbeat import Heartbeat
from common.protocol import Names
from common.watchdog import STALLED_EXIT_CODE, Watchdog
from infra.launcher import free_port
from tests.redis_servers import private_namespace

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Exited(SystemExit):  # as os._exit would, it ends a thread quietly
    pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(watchdog_module.time, "monotonic", c)
    return c


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Exit codes `Watchdog.fire` ended the process with (it raises `Exited` instead)."""
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(watchdog_module.os, "_exit", fake_exit)
    monkeypatch.setattr(watchdog_module, "_exit_after", lambda seconds: None)  # no real exit later
    return codes


def _checks(dog: Watchdog, clock: Clock, seconds: float, interval: float = 0.5, reachable: bool = True) -> None:
    """The heartbeat thread checking every ``interval`` for ``seconds`` while the loop does not turn."""
    for _ in range(round(seconds / interval)):
        clock.now += interval
        dog.check(lambda: None, interval, reachable)


def test_stall_counts_from_the_last_tick_and_only_once_armed(clock: Clock) -> None:
    dog = Watchdog("the loop", 10.0)
    clock.now += 1000
    assert dog.stalled_for() is None  # never ticked: the loop has not started (a model loading)
    dog.tick()
    clock.now += 10.0
    assert dog.stalled_for() is None
    clock.now += 0.5
    assert dog.stalled_for() == pytest.approx(10.5)
    dog.tick()
    assert dog.stalled_for() is None


def test_a_stall_withdraws_and_exits_with_its_code(clock: Clock, exits: list[int]) -> None:
    dog = Watchdog("the loop", 10.0)
    withdrawn: list[bool] = []
    dog.tick()
    _checks(dog, clock, 10.0)
    assert not exits
    with pytest.raises(Exited):
        _checks(dog, clock, 1.0)
    assert exits == [STALLED_EXIT_CODE]
    dog.tick()
    with pytest.raises(Exited):
        clock.now += 10.5
        dog.check(lambda: withdrawn.append(True), 10.0)  # (a late check is no freeze at a 10 s interval)
    assert withdrawn == [True]


def test_exits_even_when_it_cannot_withdraw(clock: Clock, exits: list[int]) -> None:
    def unreachable() -> None:
        raise ConnectionError("Redis is gone")

    dog = Watchdog("the loop", 1.5)
    dog.tick()
    with pytest.raises(Exited):
        for _ in range(10):
            clock.now += 0.25
            dog.check(unreachable, 0.25)
    assert exits == [STALLED_EXIT_CODE]


def test_a_frozen_process_is_no_stall(clock: Clock, exits: list[int]) -> None:
    """A check more than twice the interval plus a second late: the checker was frozen too (the
    whole process), and that time does not count."""
    dog = Watchdog("the loop", 10.0)
    dog.tick()
    _checks(dog, clock, 2.0)
    clock.now += 60.0  # SIGSTOP for a minute
    dog.check(lambda: None, 0.5)
    _checks(dog, clock, 7.5)
    assert not exits
    with pytest.raises(Exited):
        _checks(dog, clock, 1.0)  # 2 + 7.5 + 1 s of checked time


def test_a_redis_outage_is_excused_for_its_length_only(clock: Clock, exits: list[int]) -> None:
    dog = Watchdog("the loop", 10.0)
    dog.tick()
    _checks(dog, clock, 4.0)
    _checks(dog, clock, 60.0, reachable=False)  # the loop waits in Redis retries: no stall
    assert not exits
    with pytest.raises(Exited):
        _checks(dog, clock, 7.5)  # 4 s before, the first beat after it excused too, then 6 s more


def test_rare_failed_beats_do_not_hide_a_stuck_loop(clock: Clock, exits: list[int]) -> None:
    """One failed beat in 200 (a Redis latency spike) excuses its own interval, not a fresh limit."""
    dog = Watchdog("the loop", 120.0)
    dog.tick()
    with pytest.raises(Exited):
        for i in range(1000):
            clock.now += 0.5
            dog.check(lambda: None, 0.5, reachable=i % 200 != 199)
    assert clock.now - 1000.0 < 125


def test_limit_must_be_positive_and_beyond_a_late_check() -> None:
    with pytest.raises(ValueError, match="> 0"):
        Watchdog("the loop", 0)
    Watchdog("the loop", 3.0).check_interval(0.25)  # the tests' setting: 1.5 s heartbeats
    with pytest.raises(ValueError, match="heartbeat"):
        Watchdog("the loop", 10.0).check_interval(5.0)  # 30 s heartbeats


@pytest.mark.stack
def test_heartbeat_deletes_its_key_when_the_watched_thread_stalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    codes: list[int] = []
    gone = threading.Event()

    def fake_exit(code: int) -> None:  # the heartbeat thread stops here, as if the process had ended
        codes.append(code)
        gone.wait()

    monkeypatch.setattr(watchdog_module.os, "_exit", fake_exit)
    monkeypatch.setattr(watchdog_module, "_exit_after", lambda seconds: None)
    with private_namespace(tmp_path, "watchdog") as (redis, names, transport):
        dog = Watchdog("the loop", 2.0)
        beat = Heartbeat(transport.url, names, "executor", "e1", 0.05, 5000, dog)
        dog.tick()
        beat.start()
        try:
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:  # the loop turns: beats go on
                dog.tick()
                time.sleep(0.02)
            assert redis.exists(beat.key) and not codes
            deadline = time.monotonic() + 10  # the loop stops turning
            while not codes and time.monotonic() < deadline:
                time.sleep(0.02)
            assert codes == [STALLED_EXIT_CODE], "the heartbeat thread never noticed the stall"
            assert not redis.exists(beat.key), "the key stayed: peers would wait out its TTL"
        finally:
            beat.stop()
            gone.set()


@pytest.mark.stack
def test_heartbeat_that_cannot_reach_redis_excuses_the_loop(tmp_path: Path, exits: list[int]) -> None:
    """The working thread of a process cut off from Redis waits in retries: not a stall."""
    port = free_port()  # nothing listens there
    dog = Watchdog("the loop", 1.2)
    beat = Heartbeat(f"redis://127.0.0.1:{port}/0", Names("test-watchdog"), "executor", "e1", 0.05, 5000, dog)
    dog.tick()
    beat._thread.start()  # (`start` would beat once first, and fail)
    try:
        time.sleep(3.0)
        assert not exits and beat._thread.is_alive()
    finally:
        beat.stop()
