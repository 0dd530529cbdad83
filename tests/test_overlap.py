"""`executor.overlap` against real Redis: a read sent ahead answers when its entries land, writes land
in order without being waited for, and a connection killed under either is redone without a loss;
and the executor's loop has its next read out while a step runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common.config import ExecutorInfo
from common.protocol import ENTRY_FIELD, BindExecutor, ExecutorOutput, Names, SchedulerOutput, StepResult, decode, encode
from common.redis_errors import TRANSIENT_ERRORS
from common.transport import Outgoing, SyncTransport, renewed_ttl_ms
from executor.overlap import PendingRead, WriteBehind
from executor.service import ExecutorService, ExecutorServiceConfig
from tests.redis_servers import private_namespace

pytestmark = pytest.mark.stack


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[redis.Redis, Names, SyncTransport]]:
    with private_namespace(tmp_path, "ov") as env:
        yield env


def result(step: int) -> bytes:
    return encode(StepResult(epoch=1, step=step, token_ids=[step]))


def steps_in(r: redis.Redis, stream: str) -> list[int]:
    """The step numbers of the results (and steps) on ``stream``, in order; other messages skipped."""
    entries: Any = r.xrange(stream)
    return [m.step for m in (decode(e[ENTRY_FIELD]) for _, e in entries) if isinstance(m, (StepResult, SchedulerOutput))]


def await_result(r: redis.Redis, stream: str, step: int, timeout_s: float = 5) -> None:
    """Wait until ``stream`` holds the result of ``step`` (failing after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while step not in steps_in(r, stream):
        assert time.monotonic() < deadline, f"no result for step {step}: {steps_in(r, stream)}"
        time.sleep(0.005)


def kill(r: redis.Redis, *conns: Any) -> None:
    """Kill these redis-py connections from the server's side (found by their local address)."""
    for conn in conns:
        host, port = conn._sock.getsockname()[:2]
        r.client_kill_filter(addr=f"{host}:{port}")


def test_a_read_sent_ahead_answers_when_its_entries_land(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    r, names, t = env
    stream = names.steps("0")
    cursors: dict[str, bytes | str] = {stream: b"0-0"}
    read = PendingRead(t, cursors, count=16, block_ms=1000, expected=(StepResult,))
    time.sleep(0.05)
    assert not read.ready(), "nothing was there to read"
    pipe = r.pipeline(transaction=True)  # both land before the blocked read is answered
    pipe.xadd(stream, {ENTRY_FIELD: result(1)})
    pipe.xadd(stream, {ENTRY_FIELD: b"not msgpack"})  # dead-lettered, and read past
    pipe.execute()
    deadline = time.monotonic() + 2
    while not read.ready():
        assert time.monotonic() < deadline, "the answer never came"
        time.sleep(0.001)
    assert [msg.step for _, _, msg in read.take()] == [1]
    last: Any = r.xrevrange(stream, count=1)
    assert cursors[stream] == last[0][0] and t.num_dead_letters == 1, "the cursor moved past the rejected entry"
    assert PendingRead(t, cursors, count=16, block_ms=10, expected=(StepResult,)).take() == []


def test_writes_land_in_order_without_being_waited_for(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    r, names, t = env
    stream = names.results("0")
    writes = WriteBehind(t)
    for step in range(1, 6):
        writes.send([Outgoing(stream, result(step), 100, 60_000)])
    writes.settle()
    assert steps_in(r, stream) == [1, 2, 3, 4, 5]
    assert 60_000 < r.pttl(stream) <= renewed_ttl_ms(60_000)
    steps = names.steps("0")
    ids = [r.xadd(steps, {ENTRY_FIELD: result(n)}) for n in range(3)]
    writes.send([], trim={steps: ids[1]})  # the entries before ids[1] were taken
    writes.settle()
    writes.close()
    assert steps_in(r, steps) == [1, 2]
    r.set(names.namespace + ":a-string", "x")
    writes.send([Outgoing(names.namespace + ":a-string", b"x", None, None)])  # WRONGTYPE
    with pytest.raises(redis.ResponseError):  # Redis refused it: raised as a pipeline raises it
        writes.settle()
    writes.close()


def test_a_killed_connection_is_redone_without_a_loss(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    r, names, t = env
    stream, steps = names.results("0"), names.steps("0")
    writes = WriteBehind(t)
    writes.send([Outgoing(stream, result(1), None, None)])
    cursors: dict[str, bytes | str] = {steps: b"0-0"}
    read = PendingRead(t, cursors, count=16, block_ms=1000, expected=(StepResult,))
    kill(r, read.conn, writes.conn)
    with pytest.raises(TRANSIENT_ERRORS):
        read.take()
    assert cursors[steps] == b"0-0", "a failed read moves no cursor"
    with pytest.raises(TRANSIENT_ERRORS):  # a write into a dead socket may pass; its answer cannot
        writes.send([Outgoing(stream, result(2), None, None)])
        writes.settle()
    writes.redo()  # what may not have landed goes again: step 2 (and step 1, if its answer went unread)
    got = steps_in(r, stream)
    assert 1 in got and got[-1] == 2, got
    r.xadd(steps, {ENTRY_FIELD: result(3)})
    assert [m.step for _, _, m in PendingRead(t, cursors, count=16, block_ms=1000, expected=(StepResult,)).take()] == [3]


def test_a_send_whose_previous_answers_are_lost_is_redone_with_them(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    """`send` reads the previous send's answers first; when those are lost (its connection died),
    what this send carries was never sent: `redo` sends it too, rather than the executor losing a
    step's result (its scheduler then waited out its result timeout)."""
    r, names, t = env
    stream = names.results("0")
    writes = WriteBehind(t)
    writes.send([Outgoing(stream, result(1), None, None)])
    writes.settle()
    writes.send([Outgoing(stream, result(2), None, None)])

    def lost(*_: Any, **__: Any) -> Any:
        raise redis.ConnectionError("connection lost")

    writes.pipe.parse_response = lost  # the answers of step 2's send never come
    with pytest.raises(TRANSIENT_ERRORS):
        writes.send([Outgoing(stream, result(3), None, None)])
    writes.redo()
    assert steps_in(r, stream)[-2:] == [2, 3]  # step 2 again (it may have landed), then step 3


class _Probe:
    """A model whose every step records how many of the executor's connections sit blocked in an
    XREAD at Redis while it runs (found by their local addresses in CLIENT LIST)."""

    info = ExecutorInfo("probe", 16, 4, 64, [0], 100)

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.service: ExecutorService | None = None
        self.blocked_reads: list[int] = []

    def reset(self) -> None:
        pass

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        assert self.service is not None
        pool: Any = self.service.transport.redis.connection_pool
        conns = pool._connections  # every connection of the transport's (blocking) pool
        mine = {"{}:{}".format(*c._sock.getsockname()[:2]) for c in conns if c._sock}
        blocked = [c for c in self.r.client_list() if c["addr"] in mine and c["cmd"] == "xread" and "b" in c["flags"]]
        self.blocked_reads.append(len(blocked))
        return ExecutorOutput([7] * output.num_seqs, [])


def test_the_executor_reads_its_next_step_while_a_step_runs(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    """The executor's read of the steps stream is waiting at Redis during each step (so a step sent
    meanwhile is at hand when the current one ends), and every result still arrives, in order."""
    r, names, t = env
    probe = _Probe(r)
    service = ExecutorService(ExecutorServiceConfig(t.url, "probe", names.namespace, executor_id="e"), probe)
    probe.service = service
    serving = threading.Thread(target=service._serve, args=("0", None), daemon=True)
    serving.start()
    try:
        deadline = time.monotonic() + 5
        while not r.xlen(names.results("0")):  # its hello: it reads the steps stream from here on
            assert time.monotonic() < deadline, "the executor never said hello"
            time.sleep(0.005)
        r.xadd(names.steps("0"), {ENTRY_FIELD: encode(BindExecutor("e", "0", 1))})
        for step in range(1, 6):  # one at a time, as a scheduler waiting on each result would
            out = SchedulerOutput(step=step, epoch=1)
            out.add_scheduled("r", 1, 0, False)
            r.xadd(names.steps("0"), {ENTRY_FIELD: encode(out)})
            await_result(r, names.results("0"), step)
    finally:
        service.stopping.set()
        serving.join(5)
    assert steps_in(r, names.results("0"))[-5:] == [1, 2, 3, 4, 5]
    assert probe.blocked_reads == [1] * 5


class _Echo:
    """A model that samples token 7 for every request of a step."""

    info = ExecutorInfo("echo", 16, 4, 64, [0], 100)

    def reset(self) -> None:
        pass

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        return ExecutorOutput([7] * output.num_seqs, [])


def test_a_step_that_skips_ahead_is_ignored(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    """Within an epoch the scheduler numbers steps one by one. A step far ahead (a forged or corrupt
    entry) is ignored, and so is a repeated step: run, it would make every real step after it look
    old, and the engine would stall until the scheduler's result timeout rebound it."""
    r, names, t = env
    service = ExecutorService(ExecutorServiceConfig(t.url, "echo", names.namespace, executor_id="e"), _Echo())
    serving = threading.Thread(target=service._serve, args=("0", None), daemon=True)
    serving.start()

    def step(number: int) -> None:
        out = SchedulerOutput(step=number, epoch=1)
        out.add_scheduled("r", 1, 0, False)
        r.xadd(names.steps("0"), {ENTRY_FIELD: encode(out)})

    try:
        deadline = time.monotonic() + 5
        while not r.xlen(names.results("0")):
            assert time.monotonic() < deadline, "the executor never said hello"
            time.sleep(0.005)
        r.xadd(names.steps("0"), {ENTRY_FIELD: encode(BindExecutor("e", "0", 1))})
        for number in (1, 2**31 - 1, 1, 2):
            step(number)
        await_result(r, names.results("0"), 2)
    finally:
        service.stopping.set()
        serving.join(5)
    assert [s for s in steps_in(r, names.results("0")) if s] == [1, 2]


class _CpuLaunches:
    """A model whose launch runs the step (as on CPU: `launch_returns_early` is false); each launch
    waits up to 2 s for the step before's result to reach Redis and records whether it did."""

    info = ExecutorInfo("cpu", 16, 4, 64, [0], 100)
    launch_returns_early = False

    def __init__(self, r: redis.Redis, results: str) -> None:
        self.r, self.results = r, results
        self.before_sent: list[bool] = []

    def reset(self) -> None:
        pass

    def launch(self, output: SchedulerOutput) -> SchedulerOutput:
        if output.step > 1:
            deadline = time.monotonic() + 2
            while output.step - 1 not in steps_in(self.r, self.results) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.before_sent.append(output.step - 1 in steps_in(self.r, self.results))
        return output

    def collect(self, output: SchedulerOutput) -> ExecutorOutput:
        return ExecutorOutput([7] * output.num_seqs, [])


def test_where_a_launch_runs_the_step_the_result_before_leaves_first(env: tuple[redis.Redis, Names, SyncTransport]) -> None:
    """Steps queued behind each other on a CPU executor: each step's result is in Redis before the
    next step runs, not one step late (collected only after the next launch, as on a GPU)."""
    r, names, t = env
    model = _CpuLaunches(r, names.results("0"))
    service = ExecutorService(ExecutorServiceConfig(t.url, "cpu", names.namespace, executor_id="e"), model)
    serving = threading.Thread(target=service._serve, args=("0", None), daemon=True)
    serving.start()
    try:
        deadline = time.monotonic() + 5
        while not r.xlen(names.results("0")):
            assert time.monotonic() < deadline, "the executor never said hello"
            time.sleep(0.005)
        entries = [BindExecutor("e", "0", 1)]
        for number in range(1, 5):
            out = SchedulerOutput(step=number, epoch=1)
            out.add_scheduled("r", 1, 0, False)
            entries.append(out)  # type: ignore[arg-type]
        with r.pipeline() as pipe:  # all queued at once: each step runs with the next one read
            for entry in entries:
                pipe.xadd(names.steps("0"), {ENTRY_FIELD: encode(entry)})
            pipe.execute()
        await_result(r, names.results("0"), 4, timeout_s=10)
    finally:
        service.stopping.set()
        serving.join(5)
    assert [s for s in steps_in(r, names.results("0")) if s] == [1, 2, 3, 4]
    assert model.before_sent == [True, True, True]
