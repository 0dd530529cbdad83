"""Prometheus metrics at ``GET /metrics`` (`gateway.http.metrics`).

Unit tests: the registry is per app, `RequestMetrics` counts what it is fed, and the scheduler's
queue time reaches the gateway once per request. Then a real stack (two engines, two gateways,
tiny checkpoint; processes over real Redis and HTTP, driven by the `openai` client): /metrics is
scraped before and after a mix of requests and the deltas must be exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common.protocol import EngineStatus, Names, StepOutputs, decode, encode
from common.sampling_params import SamplingParams
from gateway.engine.client import EngineClient
from gateway.engine.handle import EngineEvent
from gateway.http.config import GatewayConfig
from gateway.http.metrics import GatewayMetrics, build_1_2_5_buckets
from gateway.http.routes import create_app
from infra.stack import Stack
from scheduler.outputs import OutputRouter
from scheduler.request import Request, StepOutput

pytestmark = pytest.mark.unit

MODEL = "tiny"


def samples(text: str) -> list[Sample]:
    """Every sample of a /metrics body (parsed as Prometheus does)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(got: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    return sum(s.value for s in got if s.name == name and labels.items() <= s.labels.items())


def label_sets(got: list[Sample], name: str) -> list[dict[str, str]]:
    return [s.labels for s in got if s.name == name]


def status(sid: str, **overrides: Any) -> EngineStatus:
    fields: dict[str, Any] = dict(
        scheduler_id=sid,
        incarnation=f"inc-{sid}",
        model_name=MODEL,
        model_path="/m",
        max_model_len=256,
        vocab_size=100,
        block_size=16,
        num_blocks=100,
        executor_id="e",
        epoch=1,
        num_free_blocks=100,
        num_running=0,
        num_waiting=0,
        num_steps=0,
        num_preemptions=0,
        num_dead_letters=0,
        updated_at=0.0,
    )
    return EngineStatus(**{**fields, **overrides})


def fake_client() -> EngineClient:
    client = EngineClient("redis://unused", Names("t-metrics"), "g1")
    client.transport.redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    return client


# -- units -----------------------------------------------------------------------------------------
def test_each_app_has_its_own_registry() -> None:
    apps = [create_app(GatewayConfig(redis_url="redis://127.0.0.1:1/0", gateway_id=f"g{i}")) for i in range(2)]
    first, second = (app.state.metrics for app in apps)
    first.request(MODEL, 7, time.monotonic()).finish("stop")
    assert value(samples(first.exposition().decode()), "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples(second.exposition().decode()), "vllm:request_success_total") == 0


def test_merged_steps_share_the_wait_since_the_last_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps the gateway read together make one event: each observes its share of the wait since
    the previous event, not the wait for one and 0 for the others."""
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    metrics = GatewayMetrics(fake_client(), lambda s: s.model_name)
    r = metrics.request(MODEL, 3, now[0])
    r.on_event(EngineEvent([1], [None]))
    now[0] += 0.06
    event = EngineEvent([2, 3, 4], [None] * 3)
    event.num_steps = 3
    r.on_event(event)
    got = samples(metrics.exposition().decode())
    assert value(got, "vllm:inter_token_latency_seconds_count") == 3
    assert value(got, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(got, "vllm:inter_token_latency_seconds_bucket", le="0.01") == 0  # none reads as 0
    assert value(got, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 3


def test_engine_series_come_from_every_engine_status() -> None:
    client = fake_client()
    client.engines = {
        "0": status(
            "0",
            num_running=3,
            num_waiting=2,
            num_free_blocks=25,
            num_preemptions=4,
            prefix_cache_queries=90,
            prefix_cache_hits=32,
            step_count=10,
            step_wall_s=0.5,
            step_forward_s=0.25,
            num_dead_letters=1,
        ),
        "1": status("1", executor_id="", num_blocks=0, num_free_blocks=0),  # between executors
    }
    client.model_info, client.num_migrations, client.redis_rtt_s = client.engines["0"], 2, 0.001
    metrics = GatewayMetrics(client, lambda s: f"served-{s.model_name}")
    got = samples(metrics.exposition().decode())
    e0 = {"model_name": "served-tiny", "engine": "0"}
    assert value(got, "vllm:num_requests_running", **e0) == 3 and value(got, "vllm:num_requests_waiting", **e0) == 2
    assert value(got, "vllm:kv_cache_usage_perc", **e0) == 0.75
    assert value(got, "vllm:kv_cache_usage_perc", engine="1") == 0.0
    assert value(got, "vllm:num_preemptions_total", **e0) == 4
    assert value(got, "vllm:prefix_cache_queries_total", **e0) == 90 and value(got, "vllm:prefix_cache_hits_total", **e0) == 32
    assert value(got, "conveyor:engine_step_seconds_count", **e0) == 10
    assert value(got, "conveyor:engine_step_seconds_sum", **e0) == 0.5
    assert value(got, "conveyor:engine_step_forward_seconds_sum", **e0) == 0.25
    assert value(got, "conveyor:dead_letters_total", **e0) == 1
    assert [s["engine"] for s in label_sets(got, "vllm:num_requests_running")] == ["0", "1"]
    assert value(got, "conveyor:migrations_total", model_name="served-tiny") == 2
    assert value(got, "conveyor:redis_rtt_seconds", model_name="served-tiny") == 0.001
    client.engines = {}  # a dead engine's series go with it
    assert label_sets(samples(metrics.exposition().decode()), "vllm:num_requests_running") == []


def test_request_metrics_count_what_they_are_fed() -> None:
    metrics = GatewayMetrics(fake_client(), lambda s: s.model_name)
    r = metrics.request(MODEL, 5, time.monotonic())
    r.on_event(EngineEvent([1], [None], queue_time_s=0.25))
    r.on_event(EngineEvent([2, 3], [None, None], queue_time_s=0.5))  # a migrated request's second queue time
    r.on_event(EngineEvent([], [], True, "length"))
    r.finish("length")
    r.finish("error")  # only the first end counts
    # A stream resumed here: the journal's tokens were counted by the gateway that delivered them.
    resumed = metrics.request(MODEL, 4, None)
    resumed.on_event(EngineEvent([7, 8], [None, None], replayed=True))
    resumed.on_event(EngineEvent([9], [None]))
    resumed.finish("stop")
    # Resumed after it ended: all of it replayed, counted where it ended (vLLM counts a request once).
    again = metrics.request(MODEL, 4, None)
    again.on_event(EngineEvent([7, 8, 9], [None] * 3, True, "stop", replayed=True))
    again.finish("stop")
    # Abandoned by its client (it may be resumed elsewhere): not a finished request, as in vLLM.
    left = metrics.request(MODEL, 6, time.monotonic())
    left.on_event(EngineEvent([4], [None]))
    left.finish("abort")
    got = samples(metrics.exposition().decode())
    m = {"model_name": MODEL}
    assert value(got, "vllm:generation_tokens_total", **m) == 3 + 1 + 1  # what reached clients from engines
    assert value(got, "vllm:prompt_tokens_total", **m) == 5 + 6  # counted at the first token it delivers
    assert value(got, "vllm:request_success_total", finished_reason="length") == 1
    assert value(got, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(got, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(got, "vllm:request_queue_time_seconds_count") == 1 and value(got, "vllm:request_queue_time_seconds_sum") == 0.25
    assert value(got, "vllm:time_to_first_token_seconds_count") == 2
    assert value(got, "vllm:inter_token_latency_seconds_count") == 1  # per engine step after the first, as vLLM
    assert value(got, "vllm:e2e_request_latency_seconds_count") == 1  # the resumed one began elsewhere
    assert value(got, "vllm:request_generation_tokens_sum") == 3 + 3 and value(got, "vllm:request_prompt_tokens_sum") == 9
    assert value(got, "vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert value(got, "vllm:request_generation_tokens_bucket", le="5.0") == 2


def test_bucket_boundaries() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-1] == 2000


def test_queue_time_travels_once_per_request() -> None:
    names = Names("t-metrics")
    router = OutputRouter(names, resume_window_s=30.0, max_message_bytes=1 << 20)
    router.add("a", "g1", "")
    router.add("b", "g1", "")
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), arrival_time=10.0)
    request.scheduled_time = 10.5
    assert request.queue_time_s == 0.5

    def route(*outs: StepOutput) -> StepOutputs:
        (send,) = router.route(list(outs))
        return decode(send.data, (StepOutputs,))

    first = route(StepOutput("a", [7], [None], False, None, 1, 0.5), StepOutput("b", [8], [None], False, None, 1, 0.1))
    assert first.queue_times() == [0.5, 0.1]
    second = route(StepOutput("a", [9], [None], False, None, 2, 0.5), StepOutput("b", [9], [None], False, None, 2, 0.1))
    assert second.queue_times() == [None, None] and second.queue_time_s == []  # the column is left out
    plain = StepOutputs()
    plain.add("c", 0, [1], None)
    assert decode(encode(plain.sealed())).queue_time_s == []


# -- the real stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tiny_model(), Path(tmp_path_factory.mktemp("metrics")), gateways=2, engines=2, executor_args=("--num-blocks", "256")
    )
    s.start()
    yield s
    s.stop()


def delta(before: list[Sample], after: list[Sample], name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def scrape(url: str) -> list[Sample]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


@pytest.mark.stack
def test_every_gateway_shows_every_engine(stack: Stack) -> None:
    model = stack.stats().model_name
    for url in stack.urls:
        got = scrape(url)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "conveyor:engine_step_seconds_count",
            "conveyor:dead_letters_total",
        ):
            assert sorted(s["engine"] for s in label_sets(got, name)) == ["0", "1"], name
            assert all(s["model_name"] == model for s in label_sets(got, name)), name
        assert all(0 <= s.value <= 1 for s in got if s.name == "vllm:kv_cache_usage_perc")
        # The request series exist (at 0) before any request, with the model's name.
        assert {"model_name": model, "finished_reason": "length"} in label_sets(got, "vllm:request_success_total")
        assert {"model_name": model} in label_sets(got, "vllm:generation_tokens_total")
        assert value(got, "conveyor:migrations_total", model_name=model) == 0
        assert value(got, "conveyor:redis_rtt_seconds", model_name=model) > 0


@pytest.mark.stack
def test_request_counts_are_exact(stack: Stack) -> None:
    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) for url in stack.urls]
    no_eos = {"ignore_eos": True}
    # A stop string the greedy output is sure to contain (found before the counting starts).
    probe = clients[0].completions.create(model="", prompt="import os\n", max_tokens=24, temperature=0, extra_body=no_eos)
    text = probe.choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2] and text[i : i + 2].strip())
    messages = [{"role": "user", "content": "Say hi"}]
    before = [scrape(url) for url in stack.urls]
    engine_steps = value(before[0], "conveyor:engine_step_seconds_count")
    queries = value(before[0], "vllm:prefix_cache_queries_total")

    # Per gateway: (prompt tokens, completion tokens) of each request, and its finish reason.
    served: list[list[tuple[int, int, str]]] = [[], []]
    for g, c in enumerate(clients):
        r = c.completions.create(model="", prompt=f"def f{g}(", max_tokens=7 + g, temperature=0, extra_body=no_eos)
        served[g].append((r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason))
        chat = c.chat.completions.create(model="", messages=messages, max_tokens=5, temperature=0.7, seed=g, extra_body=no_eos)
        served[g].append((chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.choices[0].finish_reason))
        chunks = list(
            c.completions.create(
                model="",
                prompt=f"class C{g}:",
                max_tokens=9,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=no_eos,
            )
        )
        reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        served[g].append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens, reason))
        chat_chunks = list(
            c.chat.completions.create(
                model="", messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}, extra_body=no_eos
            )
        )
        reason = [ch.choices[0].finish_reason for ch in chat_chunks if ch.choices][-1]
        served[g].append((chat_chunks[-1].usage.prompt_tokens, chat_chunks[-1].usage.completion_tokens, reason))
    # Stopped by a stop string, streaming and not: the engine is aborted; tokens after it are not the client's.
    r = clients[1].completions.create(
        model="", prompt="import os\n", max_tokens=200, temperature=0, stop=[stop], extra_body=no_eos
    )
    served[1].append((r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason))
    chunks = list(
        clients[0].completions.create(
            model="",
            prompt="import os\n",
            max_tokens=200,
            temperature=0,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
            extra_body=no_eos,
        )
    )
    served[0].append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens, "stop"))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"

    after = [scrape(url) for url in stack.urls]
    for g in (0, 1):  # each gateway counts the requests it served (Prometheus sums the gateways)
        mine, b, a = served[g], before[g], after[g]
        assert sorted({reason for _, _, reason in mine}) == ["length", "stop"]
        n = len(mine)
        assert delta(b, a, "vllm:prompt_tokens_total") == sum(p for p, _, _ in mine)
        assert delta(b, a, "vllm:generation_tokens_total") == sum(c for _, c, _ in mine)
        for reason in ("length", "stop", "abort", "error"):
            want = sum(x[2] == reason for x in mine)
            assert delta(b, a, "vllm:request_success_total", finished_reason=reason) == want, reason
        for name in (
            "vllm:time_to_first_token_seconds",
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens",
        ):
            assert delta(b, a, f"{name}_count") == n, name
            assert delta(b, a, f"{name}_bucket", le="+Inf") == n, name
        # One inter-token interval per engine step after the first, and one token per step.
        assert delta(b, a, "vllm:inter_token_latency_seconds_count") == sum(c - 1 for _, c, _ in mine)
        assert delta(b, a, "vllm:request_prompt_tokens_sum") == sum(p for p, _, _ in mine)
        assert delta(b, a, "vllm:request_generation_tokens_sum") == sum(c for _, c, _ in mine)
        assert delta(b, a, "vllm:e2e_request_latency_seconds_sum") > delta(b, a, "vllm:time_to_first_token_seconds_sum") > 0
        assert delta(b, a, "vllm:request_queue_time_seconds_sum") >= 0
    # The engines worked for both gateways; either gateway shows what they did, once it has read
    # the engines' published status (every 0.5 s) after their last steps.
    deadline = time.monotonic() + 10
    engines = after[1]
    while value(engines, "conveyor:engine_step_seconds_count") <= engine_steps and time.monotonic() < deadline:
        time.sleep(0.2)
        engines = scrape(stack.urls[1])
    assert value(engines, "conveyor:engine_step_seconds_count") > engine_steps
    assert value(engines, "vllm:prefix_cache_queries_total") > queries
    assert value(engines, "conveyor:engine_step_forward_seconds_sum") > 0, [
        (s.name, s.labels["engine"], s.value) for s in engines if s.name.startswith("conveyor:engine_step")
    ]


def _finished(got: list[Any]) -> float:
    """Requests counted as finished, whatever the reason."""
    return sum(s.value for s in got if s.name == "vllm:request_success_total")


@pytest.mark.stack
def test_client_disconnect_is_not_a_finished_request(stack: Stack) -> None:
    """As in vLLM, a request its client abandoned is aborted in the engine but not counted as
    finished (a resumable stream may still be resumed and end on another gateway)."""
    url = stack.urls[1]
    before = scrape(url)
    body = {"prompt": "def f(", "max_tokens": 1800, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3:
                break
    for sid in stack.engines():  # the engine was told
        assert stack.wait_stats(lambda s: s.num_running == 0, 3, sid).num_running == 0
    after = scrape(url)
    assert _finished(after) == _finished(before)
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == 0
    assert delta(before, after, "vllm:generation_tokens_total") >= 1  # what it did receive counts


@pytest.mark.stack
def test_resuming_an_ended_stream_counts_nothing_again(stack: Stack) -> None:
    """A stream that ended on one gateway and is read again from its journal on another (and on
    the first) is one finished request, as vLLM counts each request once."""
    body = {"prompt": "def g(", "max_tokens": 6, "stream": True, "ignore_eos": True, "temperature": 0}
    before = [scrape(url) for url in stack.urls]
    with httpx.stream("POST", f"{stack.urls[0]}/v1/completions", json=body, timeout=30) as r:
        rid = r.headers["x-request-id"]
        first = [line for line in r.iter_lines() if line.startswith("data: ")]
    for url in (stack.urls[1], stack.urls[0]):
        with httpx.stream("GET", f"{url}/v1/streams/{rid}", headers={"Last-Event-ID": "1"}, timeout=30) as r:
            assert r.status_code == 200
            again = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert again and again[-1] == "data: [DONE]" == first[-1]
    after = [scrape(url) for url in stack.urls]
    assert sum(_finished(a) - _finished(b) for a, b in zip(after, before)) == 1
    assert sum(delta(b, a, "vllm:request_generation_tokens_count") for a, b in zip(after, before)) == 1
    assert sum(delta(b, a, "vllm:generation_tokens_total") for a, b in zip(after, before)) == 6


@pytest.mark.stack
def test_concurrent_streams_count_exactly(stack: Stack) -> None:
    url = stack.urls[0]
    before = scrape(url)

    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="",
            prompt=f"x = {i} +",
            max_tokens=3 + i % 7,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return int(usage.completion_tokens)

    async def run() -> list[int]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return list(await asyncio.gather(*(one(c, i) for i in range(24))))

    tokens = asyncio.run(run())
    after = scrape(url)
    assert delta(before, after, "vllm:generation_tokens_total") == sum(tokens)
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == len(tokens)
    assert delta(before, after, "vllm:request_queue_time_seconds_count") == len(tokens)
