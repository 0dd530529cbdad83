"""Chaos: kill, freeze and restart real processes under a load of streams; nothing may be lost.

One stack (private redis-server, two engines, two gateways, tiny checkpoint, 1.5 s heartbeats)
serves every test. A no-fault run of the same load is the reference: after each fault, every
stream's text must equal it, and no client may see an error. The clients are raw SSE readers
(httpx) because a client whose gateway dies resumes on the other one (``GET /v1/streams/{id}``
with ``Last-Event-ID``), which no OpenAI client does by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from infra.stack import Stack

pytestmark = [pytest.mark.stack, pytest.mark.slow]

NUM_STREAMS = 10
MAX_TOKENS = 48


@dataclass
class StreamResult:
    text: str = ""
    errors: list[str] = field(default_factory=list)
    resumes: int = 0
    events: int = 0
    notes: list[str] = field(default_factory=list)  # why a stream had to resume
    max_gap_s: float = 0.0  # the longest wait between two events: the pause a fault caused


def _body(i: int) -> dict[str, Any]:
    """Half greedy, half seeded sampling; fixed lengths (EOS ignored)."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 1000 + i}
    return {"prompt": f"def task_{i}(x):", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True, **sampling}


async def _stream(urls: list[str], i: int, progress: list[int]) -> StreamResult:
    """One streaming completion; if its gateway dies, resume it on the next one."""
    result = StreamResult()
    response_id: str | None = None
    last_event = 0
    gateway = i % len(urls)
    last_time = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5)) as client:
        for _attempt in range(6):
            if response_id is None:
                request = client.stream("POST", f"{urls[gateway]}/v1/completions", json=_body(i))
            else:
                request = client.stream(
                    "GET", f"{urls[gateway]}/v1/streams/{response_id}", headers={"Last-Event-ID": str(last_event)}
                )
            try:
                async with request as r:
                    if r.status_code != 200:
                        result.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                        return result
                    response_id = r.headers.get("x-request-id", response_id)
                    event_id = 0
                    async for line in r.aiter_lines():
                        if line.startswith("id: "):
                            event_id = int(line[4:])
                        elif line.startswith("data: "):
                            data = line[6:]
                            if data == "[DONE]":
                                return result
                            payload = json.loads(data)
                            if "error" in payload:
                                result.errors.append(payload["error"]["message"])
                                continue
                            result.text += payload["choices"][0]["text"]
                            result.events += 1
                            now = time.monotonic()
                            if result.events > 1:  # a pause between events, not the time to the first
                                result.max_gap_s = max(result.max_gap_s, now - last_time)
                            last_time = now
                            last_event = event_id
                            progress[0] += 1
            except (httpx.TransportError, httpx.StreamError) as exc:
                if response_id is None:
                    result.errors.append(f"connection lost before the response id was known: {exc!r}")
                    return result
                result.resumes += 1
                result.notes.append(f"{urls[gateway]}: {exc!r}")
                gateway = (gateway + 1) % len(urls)
                await asyncio.sleep(0.2)
        result.errors.append("stream never completed")
    return result


def run_load(
    stack: Stack, fault: Callable[[], None] | None = None, after_events: int = 0, urls: list[str] | None = None
) -> list[StreamResult]:
    """Run NUM_STREAMS streams; call ``fault()`` (on a thread) once ``after_events`` events arrived."""

    async def main() -> list[StreamResult]:
        progress = [0]
        tasks = [asyncio.create_task(_stream(urls or stack.urls, i, progress)) for i in range(NUM_STREAMS)]
        if fault is not None:
            while progress[0] < after_events and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            assert not all(t.done() for t in tasks), "the load finished before the fault"
            await asyncio.to_thread(fault)
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tiny_model(),
        Path(tmp_path_factory.mktemp("chaos")),
        gateways=2,
        engines=2,
        private_redis=True,
        executor_args=("--num-blocks", "256"),
        scheduler_args=("--recovery-timeout", "60"),
    )
    s.start()
    yield s
    s.stop()


def reference_run(stack: Stack) -> list[str]:
    """Every stream's text in a run of the load without a fault (none may fail)."""
    results = run_load(stack)
    assert all(not r.errors and r.text for r in results), [r.errors for r in results]
    _report(results, [r.text for r in results], "none (the reference run)")
    return [r.text for r in results]


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[str]:
    return reference_run(stack)


def _report(results: list[StreamResult], reference: list[str], fault: str) -> None:
    """With CONVEYOR_CHAOS_REPORT=<file>, append one JSON line per fault (docs/reliability.md)."""
    report = os.environ.get("CONVEYOR_CHAOS_REPORT")
    if report:
        lost = sum(1 for r, want in zip(results, reference) if r.errors or r.text != want)
        line = {
            "fault": fault,
            "in_flight": len(results),
            "lost": lost,
            "resumed": sum(r.resumes > 0 for r in results),
            "max_pause_s": round(max(r.max_gap_s for r in results), 2),
        }
        with open(report, "a") as f:
            f.write(json.dumps(line) + "\n")


def _check(stack: Stack, results: list[StreamResult], reference: list[str], fault: str) -> None:
    _report(results, reference, fault)
    errors = [(i, r.errors, r.notes) for i, r in enumerate(results) if r.errors]
    assert not errors, f"{errors}\n{stack.logs(30)}"
    wrong = [i for i, (r, want) in enumerate(zip(results, reference)) if r.text != want]
    assert not wrong, f"streams {wrong} differ from the no-fault run\n{stack.logs(30)}"
    # Every engine and gateway is back for the next fault.
    deadline = time.monotonic() + 60
    while len(stack.engines()) < stack.num_engines and time.monotonic() < deadline:
        time.sleep(0.2)
    for url in stack.urls:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)


def _busiest_engine(stack: Stack) -> str:
    """The engine with the most requests running now: the fault must hit requests in flight."""
    engines = stack.engines()
    return max(engines, key=lambda sid: (engines[sid].num_running + engines[sid].num_waiting, sid))


def _log_count(stack: Stack, word: str) -> int:
    """How many lines of the gateways' logs contain ``word``."""
    return sum(
        line.count(word)
        for i in range(stack.num_gateways)
        for line in (stack.workdir / f"gateway{i}.log").read_text(errors="replace").splitlines()
    )


def _kill(stack: Stack, name: str) -> None:
    proc = stack.procs[name]
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("role", ["executor", "scheduler"])
def test_engine_part_killed_and_restarted(stack: Stack, reference: list[str], role: str) -> None:
    """An executor's death is a pause; a scheduler's requests migrate (to the other engine, or to
    the restarted scheduler)."""

    def fault() -> None:
        engine = _busiest_engine(stack)
        _kill(stack, f"{role}{engine}")
        (stack.spawn_executor if role == "executor" else stack.spawn_scheduler)(int(engine))

    migrations_before = _log_count(stack, "migrating")
    results = run_load(stack, fault, after_events=NUM_STREAMS * 4)
    label = "executor kill -9 + restart" if role == "executor" else "scheduler kill -9 (1 of 2 engines)"
    _check(stack, results, reference, label)
    if role == "executor":
        assert max(r.max_gap_s for r in results) > 1.0, "no stream paused: the fault missed every request"
    else:  # a migration can be quicker than a second: count them instead
        assert _log_count(stack, "migrating") > migrations_before, "no request migrated: the fault missed them all"


def test_gateway_frozen_past_its_ttl_gets_back_what_it_missed(stack: Stack, reference: list[str]) -> None:
    """SIGSTOP a gateway for four heartbeat TTLs: schedulers declare it gone, abort its
    non-streaming requests and orphan its streams (which end meanwhile), telling it nothing. Once it
    runs again it asks the engines for what it misses, and what they no longer hold migrates: the
    non-streaming request and every stream end as without the fault."""
    # long enough to be running when the schedulers give the gateway up
    body = {"prompt": "def frozen(x):", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    want = httpx.post(f"{stack.urls[1]}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    answer: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: answer.append(httpx.post(f"{stack.urls[0]}/v1/completions", json=body, timeout=60)))

    def fault() -> None:
        waiter.start()
        time.sleep(0.3)
        proc = stack.procs["gateway0"]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(4 * stack.heartbeat_ttl_ms / 1000)
        proc.send_signal(signal.SIGCONT)

    results = run_load(stack, fault, after_events=NUM_STREAMS * 4)
    waiter.join(90)
    _check(stack, results, reference, "gateway SIGSTOP for 4 heartbeat TTLs")
    assert answer and answer[0].status_code == 200, "the non-streaming request was never answered"
    assert answer[0].json()["choices"][0]["text"] == want
    assert _log_count(stack, "did not run for") >= 1


def test_gateway_killed_streams_resume_elsewhere(stack: Stack, reference: list[str]) -> None:
    resumed: list[int] = []

    def fault() -> None:
        _kill(stack, "gateway0")

    results = run_load(stack, fault, after_events=NUM_STREAMS * 4)
    resumed = [i for i, r in enumerate(results) if r.resumes]
    stack.spawn_gateway(0)
    assert resumed, "no stream was on the killed gateway"
    _check(stack, results, reference, "gateway kill -9 (1 of 2), streams resumed")


@dataclass
class ChoicesRead:
    """What a raw SSE reader has of a stream with several choices."""

    texts: dict[int, str] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    usage: list[int] = field(default_factory=list)
    last_id: str = ""
    events: int = 0

    def read(self, r: httpx.Response, on_event: Callable[[int], None] = lambda _: None) -> None:
        for line in r.iter_lines():
            if line.startswith("id: "):
                self.last_id = line[4:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                self.usage.extend([chunk["usage"]["completion_tokens"]] if chunk.get("usage") else [])
                for choice in chunk["choices"]:
                    self.texts[choice["index"]] = self.texts.get(choice["index"], "") + choice["text"]
                    if choice["finish_reason"]:
                        self.finished[choice["index"]] = choice["finish_reason"]
                self.events += 1
                on_event(self.events)


def test_gateway_killed_mid_multi_choice_stream_resumes_elsewhere(stack: Stack) -> None:
    """SIGKILL the gateway serving an ``n`` = 2 stream: its engine journals both choices (orphans)
    and the other gateway resumes them from the last event id; each ends with its full length,
    token for token the same as the uninterrupted (non-streamed) request."""
    max_tokens = 200
    body = {"prompt": "def pair(x):", "n": 2, "max_tokens": max_tokens, "temperature": 0.9, "seed": 21, "ignore_eos": True}
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    got = ChoicesRead()

    def kill_at_10(events: int) -> None:  # mid-stream: 2 x 200 tokens take far more than 10 events
        if events == 10:
            _kill(stack, "gateway0")

    with httpx.Client(timeout=httpx.Timeout(120, connect=5)) as http:
        want = [c["text"] for c in http.post(f"{stack.urls[1]}/v1/completions", json=body).json()["choices"]]
        with pytest.raises((httpx.TransportError, httpx.StreamError)):
            with http.stream("POST", f"{stack.urls[0]}/v1/completions", json=stream_body) as r:
                rid = r.headers["x-request-id"]
                got.read(r, kill_at_10)
        assert got.events >= 10 and not got.finished
        with http.stream("GET", f"{stack.urls[1]}/v1/streams/{rid}", headers={"Last-Event-ID": got.last_id}) as r:
            assert r.status_code == 200
            got.read(r)
    stack.spawn_gateway(0)
    assert got.finished == {0: "length", 1: "length"} and got.usage == [2 * max_tokens]
    assert [got.texts[0], got.texts[1]] == want
    deadline = time.monotonic() + 60  # gateway0 back for the next test
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{stack.urls[0]}/health", timeout=2).status_code == 200:
                break
        time.sleep(0.2)


def test_stream_resumed_elsewhere_while_served_ends_the_first_copy(stack: Stack) -> None:
    """A stream is resumed on gateway1 while gateway0 still serves it (its client never noticed a
    fault): gateway0's copy ends with an error naming the takeover instead of waiting forever, the
    resumed copy runs to the end, and gateway0 no longer holds the stream (resumable there again)."""
    body = {"prompt": "def twice(x):", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
    ended: list[str] = []
    started = threading.Event()
    rid: list[str] = []

    def read_first() -> None:
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http:
            with http.stream("POST", f"{stack.urls[0]}/v1/completions", json=body) as r:
                rid.append(r.headers["x-request-id"])
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: ") and "error" in line:
                        ended.append(line)
        ended.append("closed")

    def finished_on_gateway0() -> float:  # requests counted as finished there, whatever the reason
        metrics = httpx.get(f"{stack.urls[0]}/metrics", timeout=10).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics if line.startswith("vllm:request_success_total{"))

    counted = finished_on_gateway0()
    reader = threading.Thread(target=read_first)
    reader.start()
    assert started.wait(30)
    second = ChoicesRead()
    with httpx.stream("GET", f"{stack.urls[1]}/v1/streams/{rid[0]}", headers={"Last-Event-ID": "0"}, timeout=60) as r:
        assert r.status_code == 200
        second.read(r)
    reader.join(20)
    assert not reader.is_alive(), "gateway0's copy of the stream waited on after the takeover"
    assert ended[-1] == "closed" and any("resumed on gateway" in line for line in ended), ended
    assert second.finished == {0: "length"}
    assert finished_on_gateway0() == counted  # the copy that ended is no finished request: gateway1 counts it
    want = httpx.post(f"{stack.urls[1]}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert second.texts[0] == want["choices"][0]["text"]
    with httpx.stream("GET", f"{stack.urls[0]}/v1/streams/{rid[0]}", headers={"Last-Event-ID": "0"}, timeout=60) as r:
        assert r.status_code == 200  # not 409 stream_in_use: gateway0 let its copy go
        again = ChoicesRead()
        again.read(r)
    assert again.texts[0] == want["choices"][0]["text"]


def test_a_stream_resumed_at_once_where_its_client_hung_up_goes_on(stack: Stack) -> None:
    """The client hangs up mid-stream and at once resumes on the same gateway. That gateway's abort
    of the first copy must not end the resumed one (it did in most tries: the resumed stream then
    waited forever); each resumed stream ends with the uninterrupted text."""
    url = stack.urls[0]
    for i in range(8):
        body = {"prompt": f"def hang_up_{i}(x):", "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}
        first = ""
        with httpx.Client(timeout=httpx.Timeout(30, connect=5)) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                rid, last, seen = r.headers["x-request-id"], "0", 0
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        last = line[4:]
                    elif line.startswith("data: "):
                        first += json.loads(line[6:])["choices"][0]["text"]
                        seen += 1
                        if seen == 4:
                            break  # hang up
            with http.stream("GET", f"{url}/v1/streams/{rid}", headers={"Last-Event-ID": last}) as r:
                assert r.status_code == 200
                rest = ChoicesRead()
                rest.read(r)
            want = http.post(f"{url}/v1/completions", json={**body, "stream": False}).json()["choices"][0]["text"]
        assert rest.finished == {0: "length"}, f"try {i}: {rest.finished}"
        assert first + rest.texts[0] == want, f"try {i}"


def test_redis_restarted(stack: Stack, reference: list[str]) -> None:
    first_success: list[float] = []

    def fault() -> None:
        stack.restart_redis(1.0)
        back = time.monotonic()
        client = openai.OpenAI(base_url=f"{stack.urls[1]}/v1", api_key="x", max_retries=0, timeout=10)
        while time.monotonic() - back < 30:
            try:
                r = client.completions.create(model="", prompt="new", max_tokens=4, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 4
                first_success.append(time.monotonic() - back)
                return
            except (openai.APIStatusError, openai.APIConnectionError):
                time.sleep(0.1)

    _check(stack, run_load(stack, fault, after_events=NUM_STREAMS * 4), reference, "Redis restart (1 s down)")
    assert first_success and first_success[0] < 5.0, f"a new request succeeded {first_success} s after Redis was back"


def test_executor_frozen_for_10s(stack: Stack, reference: list[str]) -> None:
    def fault() -> None:
        proc = stack.procs[f"executor{_busiest_engine(stack)}"]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(10)
        proc.send_signal(signal.SIGCONT)

    results = run_load(stack, fault, after_events=NUM_STREAMS * 4)
    _check(stack, results, reference, "executor SIGSTOP 10 s")
    longest = max(r.max_gap_s for r in results)
    assert longest > 2.0, "no stream paused: the fault missed every request"
    # The other engine has an executor: the frozen one's requests move there after two TTLs
    # without one (about 5 s here), rather than waiting out the freeze.
    assert longest < 10.0, f"a stream waited {longest:.1f} s for the frozen executor"


def test_a_stream_failed_for_want_of_an_engine_can_be_resumed_to_its_error(
    tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The only engine's scheduler dies for good: the stream waits for an engine for the recovery
    timeout (5 s), longer than the resume window (3 s) after its last event, then fails. A client
    that lost the connection meanwhile resumes and gets the error, not a 404: the journal must not
    expire under the waiting stream."""
    s = Stack(
        tiny_model(),
        Path(tmp_path_factory.mktemp("no-engine")),
        executor_args=("--num-blocks", "256"),
        gateway_args=("--recovery-timeout", "5", "--resume-window", "3"),
    )
    s.start()
    try:
        body = {"prompt": "def wait(x):", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http:
            with http.stream("POST", f"{s.urls[0]}/v1/completions", json=body) as r:
                rid, seen, lines = r.headers["x-request-id"], 0, []
                for line in r.iter_lines():
                    lines.append(line)
                    seen += line.startswith("data: ")
                    if seen == 3:
                        _kill(s, "scheduler0")
            assert any("no live engine" in line for line in lines), lines[-3:]
            with http.stream("GET", f"{s.urls[0]}/v1/streams/{rid}", headers={"Last-Event-ID": "1"}) as r:
                assert r.status_code == 200, r.read()
                resumed = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "no live engine" in resumed[-2] and resumed[-1] == "data: [DONE]", resumed[-3:]
    finally:
        s.stop()
