"""`Watchdog` alone (a fake clock) and with a real `Heartbeat` on the local Redis; the services'
watchdogs against real hung processes are in `tests/test_stalls.py`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import common.watchdog as watchdog_module
from common.heartbeat import Heartbeat
from common.watchdog import STALLED_EXIT_CODE, Watchdog
from tests.redis_servers import private_namespace


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
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(watchdog_module.os, "_exit", fake_exit)
    return codes


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
    for _ in range(4):  # checked every 2.5 s while the loop does not turn
        clock.now += 2.5
        dog.check(lambda: withdrawn.append(True))
    assert not withdrawn and not exits
    clock.now += 2.5
    with pytest.raises(Exited):
        dog.check(lambda: withdrawn.append(True))
    assert withdrawn == [True] and exits == [STALLED_EXIT_CODE]


def test_exits_even_when_it_cannot_withdraw(clock: Clock, exits: list[int]) -> None:
    dog = Watchdog("the loop", 1.0)
    dog.tick()
    clock.now += 0.2
    dog.check(lambda: None)

    def unreachable() -> None:
        raise ConnectionError("Redis is gone")

    clock.now += 0.2
    dog.check(unreachable)  # not stalled: nothing is called
    for _ in range(5):
        clock.now += 0.2
        try:
            dog.check(unreachable)
        except Exited:
            break
    assert exits == [STALLED_EXIT_CODE]


def test_a_frozen_process_is_no_stall(clock: Clock, exits: list[int]) -> None:
    """The checker did not run for longer than a quarter of the limit: the whole process was
    frozen, and the working thread gets a whole limit from now."""
    dog = Watchdog("the loop", 10.0)
    dog.tick()
    dog.check(lambda: None)
    clock.now += 60.0  # SIGSTOP for a minute
    dog.check(lambda: None)
    assert not exits
    clock.now += 9.0
    dog.check(lambda: None)
    assert not exits and dog.stalled_for() is None


def test_waiting_for_redis_is_excused(clock: Clock, exits: list[int]) -> None:
    dog = Watchdog("the loop", 10.0)
    dog.tick()
    for _ in range(20):  # 40 s of Redis down: each failed beat excuses the loop blocked in its retries
        clock.now += 2.0
        dog.check(lambda: None)
        dog.excuse()
    assert not exits


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        Watchdog("the loop", 0)


def test_heartbeat_deletes_its_key_when_the_watched_thread_stalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    codes: list[int] = []
    gone = threading.Event()

    def fake_exit(code: int) -> None:  # the heartbeat thread stops here, as if the process had ended
        codes.append(code)
        gone.wait()

    monkeypatch.setattr(watchdog_module.os, "_exit", fake_exit)
    with private_namespace(tmp_path, "watchdog") as (redis, names, transport):
        dog = Watchdog("the loop", 0.3)
        beat = Heartbeat(transport.url, names, "executor", "e1", 0.05, 5000, dog)
        dog.tick()
        beat.start()
        try:
            deadline = time.monotonic() + 0.6
            while time.monotonic() < deadline:  # the loop turns: beats go on
                dog.tick()
                time.sleep(0.02)
            assert redis.exists(beat.key) and not codes
            deadline = time.monotonic() + 5  # the loop stops turning
            while not codes and time.monotonic() < deadline:
                time.sleep(0.02)
            assert codes == [STALLED_EXIT_CODE], "the heartbeat thread never noticed the stall"
            assert not redis.exists(beat.key), "the key stayed: peers would wait out its TTL"
        finally:
            beat.stop()
            gone.set()
