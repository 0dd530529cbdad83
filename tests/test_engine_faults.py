"""Faults inside one engine, with the scheduler and executor services on threads of this process.

Real Redis and a real `ModelExecutor`; the test plays the gateway on the streams.
- A request that makes the executor's step fail (a poisoned request: as a bad kernel input or a
  sampler bug would) is failed alone; the others in the step finish with the offline tokens.
- Without an executor for ``--recovery-timeout``, requests fail with a clear error, not a hang.
- A stream resumed at once (on another gateway, or on the one its client hung up on) is not
  stopped by the abort its first copy sent.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from common.config import CacheConfig, ModelConfig, ParallelConfig
from common.protocol import AbortRequests, EngineStatus, GenerateRequest, Names, StepOutputs, SyncRequest, decode, encode
from common.sampling_params import SamplingParams
from executor.service import ExecutorService, ExecutorServiceConfig
from infra.stack import find_redis
from scheduler.service import SchedulerService, SchedulerServiceConfig

pytestmark = pytest.mark.stack

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


class PoisonedExecutor:
    """A real `ModelExecutor` that fails every step holding a request whose id contains 'poison'."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info
        self.failed_steps = 0
        self.device_broken = False  # a failed step leaves the device unusable (a sticky CUDA error)

    def execute_model(self, output: Any) -> Any:
        if any("poison" in r for r in output.scheduled_req_ids):
            self.failed_steps += 1
            raise RuntimeError("poisoned request in the batch")
        return self.inner.execute_model(output)

    def reset(self) -> None:
        self.inner.reset()

    def check_device(self) -> None:
        if self.device_broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@dataclass
class Engine:
    """One scheduler + executor on threads, and the test's view of the streams as gateway 'gw'."""

    r: redis.Redis
    names: Names
    executor: ExecutorService
    scheduler: SchedulerService
    threads: list[threading.Thread]
    incarnation: str = ""
    cursor: bytes | str = "0-0"
    tokens: dict[str, list[int]] = field(default_factory=dict)
    ends: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    def submit(self, request_id: str, prompt: list[int], sampling: dict[str, Any] | None = None) -> None:
        self.tokens[request_id] = []
        msg = GenerateRequest(request_id, "gw", "0", self.incarnation, prompt, [], sampling or GREEDY, 0.0)
        self.r.xadd(self.names.requests("0"), {b"m": encode(msg)})

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ends) < len(self.tokens):
            assert time.monotonic() < deadline, f"requests never finished: {self.ends}"
            for _, entries in self.r.xread({self.names.outputs("gw"): self.cursor}, block=500) or []:
                for entry_id, entry in entries:
                    self.cursor = entry_id
                    out = decode(entry[b"m"], (StepOutputs,))
                    pos = 0
                    for i, request_id in enumerate(out.request_ids):
                        n, have = out.num_tokens[i], self.tokens[request_id]
                        assert out.token_index[i] <= len(have), "a gap in the outputs"
                        have.extend(out.token_ids[pos : pos + n][len(have) - out.token_index[i] :])
                        pos += n
                        if out.finished[i]:
                            self.ends[request_id] = (out.finish_reasons[i], out.errors[i])


@pytest.fixture
def engine(tiny_model: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Engine]:
    from executor.model_executor import ModelExecutor

    url, _ = find_redis(tmp_path)
    names = Names(f"test-{uuid.uuid4().hex[:10]}")
    r = redis.Redis.from_url(url)
    model = str(tiny_model())
    inner = PoisonedExecutor(ModelExecutor(ModelConfig(model), ParallelConfig(), CacheConfig(num_blocks=128)))
    executor = ExecutorService(ExecutorServiceConfig(url, model, names.namespace, heartbeat_ttl_ms=1500), inner)
    recovery_s = getattr(request, "param", 60.0)
    scheduler = SchedulerService(
        SchedulerServiceConfig(url, names.namespace, heartbeat_ttl_ms=1500, recovery_timeout_s=recovery_s)
    )
    threads = [threading.Thread(target=s.run, daemon=True) for s in (executor, scheduler)]
    for thread in threads:
        thread.start()
    e = Engine(r, names, executor, scheduler, threads)
    try:
        deadline = time.monotonic() + 30
        while not (status := r.get(names.engine("0"))) or not decode(status, (EngineStatus,)).executor_id:
            assert time.monotonic() < deadline, "the engine never came up"
            time.sleep(0.05)
        e.incarnation = decode(status, (EngineStatus,)).incarnation
        r.set(names.heartbeat("gateway", "gw"), "1", px=120_000)
        yield e
    finally:
        scheduler.stop()
        executor.stopping.set()
        for thread in threads:
            thread.join(10)
        keys = list(r.scan_iter(match=f"{names.namespace}:*"))
        if keys:
            r.delete(*keys)


def test_failing_request_fails_alone(engine: Engine, tiny_model: Any) -> None:
    from gateway.llm import LLM

    prompts = {"a": [5, 6, 7], "poison": [8, 9], "b": [10, 11, 12, 13], "c": [14]}
    for request_id, prompt in prompts.items():
        engine.submit(request_id, prompt)
    engine.wait_all(60)
    assert engine.ends["poison"][0] == "error" and "poisoned request" in (engine.ends["poison"][1] or "")
    assert engine.tokens["poison"] == []
    llm = LLM(str(tiny_model()), num_blocks=128)
    for request_id in ("a", "b", "c"):
        assert engine.ends[request_id] == ("length", None)
        want = llm.generate([prompts[request_id]], SamplingParams(**GREEDY))[0].token_ids
        assert engine.tokens[request_id] == want, request_id
    assert engine.executor.model.failed_steps >= 2  # type: ignore[attr-defined]  # the mixed step, then alone


def test_an_engine_bug_after_a_request_finished_still_sends_its_end(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step after ``short`` finished fails in the scheduler (a bug): ``short``'s last output,
    queued to ride with that step, still goes out; ``long`` fails with the error."""
    from scheduler.scheduler import Scheduler

    real, admitted, raised = Scheduler.schedule, threading.Event(), threading.Event()

    def schedule(self: Scheduler) -> Any:
        if "short" in engine.scheduler.router.routes:
            admitted.set()
        elif admitted.is_set() and not raised.is_set():  # its last output is routed, not yet sent
            raised.set()
            raise RuntimeError("injected scheduler bug")
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    engine.submit("long", [5, 6, 7], {**GREEDY, "max_tokens": 200})
    engine.submit("short", [8, 9], {**GREEDY, "max_tokens": 2})
    engine.wait_all(30)
    assert raised.is_set()
    assert engine.ends["short"] == ("length", None) and len(engine.tokens["short"]) == 2
    assert engine.ends["long"][0] == "error" and "injected scheduler bug" in (engine.ends["long"][1] or "")


@pytest.mark.parametrize("engine", [3.0], indirect=True)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the executor's thread ends with it
def test_an_executor_whose_device_broke_exits_and_its_requests_are_not_blamed(engine: Engine) -> None:
    """Every step fails and the device is unusable: the executor exits (a supervisor would restart
    it) instead of reporting each request in turn as the culprit of a failed step."""
    engine.executor.model.device_broken = True  # type: ignore[attr-defined]
    for request_id in ("poison-a", "poison-b", "poison-c"):  # every step of theirs fails
        engine.submit(request_id, [5, 6, 7])
    engine.threads[0].join(15)
    assert not engine.threads[0].is_alive()  # the executor service ended
    engine.wait_all(30)  # no executor comes back: past --recovery-timeout they fail as waiting ones do
    for reason, error in engine.ends.values():
        assert reason == "error" and "no executor for" in (error or ""), error


@pytest.mark.parametrize("engine", [2.0], indirect=True)
def test_no_executor_past_the_recovery_timeout_fails_requests_clearly(engine: Engine) -> None:
    engine.executor.stopping.set()  # the executor goes away (its heartbeat stops with it)
    engine.threads[0].join(10)
    t0 = time.monotonic()
    engine.submit("late", [5, 6, 7])
    engine.wait_all(30)
    reason, error = engine.ends["late"]
    assert reason == "error" and "no executor for" in (error or "") and "recovery timeout" in (error or "")
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("resumer", ["gw2", "gw"])
def test_an_abort_from_before_a_resume_is_ignored(engine: Engine, resumer: str) -> None:
    """The client hung up on gateway 'gw' and resumed at once, on 'gw2' or on 'gw' itself: the
    scheduler reads gw's abort and the resumer's sync together; the stream goes on, to the resumer,
    to its end. (On 'gw' itself the abort cannot be told from a later one by its gateway: that it
    came before the sync is what makes it stale; the gateway sees to that order, `gateway.engine.aborts`.)"""
    sampling = {**GREEDY, "max_tokens": 300}
    request = GenerateRequest("s", "gw", "0", engine.incarnation, [5, 6, 7], [], sampling, 0.0, "resp")
    engine.r.set(engine.names.heartbeat("gateway", "gw2"), "1", px=120_000)
    engine.r.xadd(engine.names.requests("0"), {b"m": encode(request)})
    engine.tokens["s"] = []
    while not engine.r.xlen(engine.names.outputs("gw")):
        time.sleep(0.01)
    pipe = engine.r.pipeline(transaction=True)  # one batch for the scheduler's reader
    pipe.xadd(engine.names.requests("0"), {b"m": encode(AbortRequests(["s"], "client", "gw"))})
    pipe.xadd(engine.names.requests("0"), {b"m": encode(SyncRequest("s", resumer, 0))})
    pipe.execute()
    engine.cursor, gw2 = "0-0", engine.names.outputs(resumer)
    deadline = time.monotonic() + 60
    while "s" not in engine.ends:
        assert time.monotonic() < deadline, "the adopted stream never finished"
        for _, entries in engine.r.xread({gw2: engine.cursor}, block=500) or []:
            for entry_id, entry in entries:
                engine.cursor = entry_id
                out = decode(entry[b"m"], (StepOutputs,))
                pos = 0
                for i in range(len(out.request_ids)):
                    have, n = engine.tokens["s"], out.num_tokens[i]
                    have.extend(out.token_ids[pos : pos + n][len(have) - out.token_index[i] :])
                    pos += n
                    if out.finished[i]:
                        engine.ends["s"] = (out.finish_reasons[i], out.errors[i])
    assert engine.ends["s"] == ("length", None) and len(engine.tokens["s"]) == 300


def test_a_bind_read_twice_resets_nothing_and_runs_no_step_twice() -> None:
    """A retried send may append the scheduler's batch twice: [bind, step 41] [bind, step 41, step 42]."""
    from types import SimpleNamespace

    from common.protocol import BindExecutor, ExecutorOutput, SchedulerOutput

    ran: list[int] = []
    resets: list[int] = []
    model = SimpleNamespace(
        info=SimpleNamespace(model_name="m", num_blocks=8, block_size=16, max_model_len=64, vocab_size=100, eos_token_ids=[0]),
        execute_model=lambda output: ran.append(output.step) or ExecutorOutput([1], [None]),
        reset=lambda: resets.append(1),
    )
    service = ExecutorService(ExecutorServiceConfig("redis://127.0.0.1:1/0", "m", "dup", executor_id="e1"), model)
    sends: list[Any] = []
    bind, step41, step42 = BindExecutor("e1", "s", 7), SchedulerOutput(step=41, epoch=7), SchedulerOutput(step=42, epoch=7)
    for msg in (bind, step41, bind, step41, step42):
        service._handle(msg, "results:s", sends)
    service._flush("results:s", sends)  # the last step's result (the loop flushes when nothing is queued)
    assert ran == [41, 42] and len(resets) == 1 and len(sends) == 2


def test_a_stopped_executor_takes_its_heartbeat_with_it(engine: Engine) -> None:
    key = engine.names.heartbeat("executor", engine.executor.eid)
    assert engine.r.exists(key)
    engine.executor.stopping.set()
    engine.threads[0].join(10)
    assert not engine.threads[0].is_alive() and not engine.r.exists(key)  # not a TTL later


def test_redis_refusing_writes_for_a_while_loses_nothing(engine: Engine, tiny_model: Any) -> None:
    """Out of memory for 1.5 s mid-stream (maxmemory reached; a read-only replica or a failing disk
    are refused alike): the executor and the scheduler wait it out, the stream finishes whole.
    Before, the executor exited and the scheduler failed every request as an engine bug."""
    from gateway.llm import LLM

    sampling = {**GREEDY, "max_tokens": 160}
    engine.submit("a", [5, 6, 7], sampling)
    deadline = time.monotonic() + 30
    while not engine.r.xlen(engine.names.outputs("gw")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = engine.r.config_get("maxmemory")["maxmemory"]
    engine.r.config_set("maxmemory", 1)
    try:
        time.sleep(1.5)
    finally:
        engine.r.config_set("maxmemory", before)
    engine.wait_all(60)
    assert engine.ends["a"] == ("length", None)
    want = LLM(str(tiny_model()), num_blocks=128).generate([[5, 6, 7]], SamplingParams(**sampling))[0].token_ids
    assert engine.tokens["a"] == want
    assert all(thread.is_alive() for thread in engine.threads)
