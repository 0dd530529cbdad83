"""`conveyor bench serve`: its metrics on synthetic timings, its SSE client on canned streams, and
whole runs against a real stack of the tiny model (completions and chat, random and .jsonl
datasets, with and without Poisson arrivals). No timing is asserted, only counts and fields."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.serve_client import SseEvents, request_body, send_request
from bench.serve_data import SAFE_IDS, BenchRequest, TokenSource, arrival_delays, jsonl_requests, random_requests
from bench.serve_metrics import RequestResult, compute_metrics, format_report
from infra.stack import Stack

pytestmark = pytest.mark.stack

# vLLM's benchmark_serving result fields: every run's result file must hold them.
FIELDS = [
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
] + [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")]


# -- metrics on synthetic timings --------------------------------------------------------------
def test_metrics_follow_vllm_definitions() -> None:
    requests = [BenchRequest([20] * 10, 10, 4), BenchRequest([20] * 20, 20, 1), BenchRequest([20] * 5, 5, 3)]
    results = [
        RequestResult(success=True, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, prompt_tokens=11, output_tokens=4, chunks=4),
        RequestResult(success=True, ttft=0.3, latency=0.3, output_tokens=1, chunks=1),  # no usage: prompt_len counts
        RequestResult(success=False, error="HTTP 500: boom"),
    ]
    m = compute_metrics(requests, results, duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (11 + 20, 5)  # the server's count wins
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(36 / 2)
    # TTFT over the successful requests; p99 interpolated linearly (numpy's default, as vLLM).
    assert (m["mean_ttft_ms"], m["median_ttft_ms"]) == (pytest.approx(200), pytest.approx(200))
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    # TPOT excludes the first token and one-token requests: (0.2 - 0.1) / (4 - 1) only.
    for stat in ("mean", "median", "p99"):
        assert m[f"{stat}_tpot_ms"] == pytest.approx(100 / 3)
    # ITL over every gap of every request.
    assert m["mean_itl_ms"] == pytest.approx(100 / 3)
    assert m["median_itl_ms"] == pytest.approx(30)
    assert m["p99_itl_ms"] == pytest.approx(30 + 0.98 * 20)
    assert (m["mean_e2el_ms"], m["median_e2el_ms"]) == (pytest.approx(250), pytest.approx(250))
    assert m["std_e2el_ms"] == pytest.approx(50)
    report = format_report(m)
    assert "Failed requests:                         1" in report and "P99 ITL (ms):" in report


def test_metrics_without_usage_and_without_successes() -> None:
    class WordTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [0] * len(text.split())

    requests = [BenchRequest("a b", None, 8)]
    result = RequestResult(success=True, ttft=0.1, itl=[0.1], latency=0.3, chunks=2, text="one two three")
    assert compute_metrics(requests, [result], 1.0)["total_output_tokens"] == 2  # the chunks, last resort
    m = compute_metrics(requests, [result], 1.0, WordTokenizer())
    assert m["total_output_tokens"] == 3 and m["total_input_tokens"] == 0  # prompt length unknown: not guessed
    assert m["mean_tpot_ms"] == pytest.approx(100)
    empty = compute_metrics(requests, [RequestResult(error="x")], 1.0)
    assert (empty["completed"], empty["failed"], empty["mean_ttft_ms"], empty["p99_itl_ms"]) == (0, 1, 0.0, 0.0)


def test_poisson_arrivals() -> None:
    assert arrival_delays(5, float("inf")) == [0.0] * 5
    delays = arrival_delays(4000, 10.0, seed=3)
    assert delays[0] == 0.0 and all(d > 0 for d in delays[1:])
    assert sum(delays) / 3999 == pytest.approx(0.1, rel=0.1)
    assert delays == arrival_delays(4000, 10.0, seed=3) != arrival_delays(4000, 10.0, seed=4)


# -- datasets ----------------------------------------------------------------------------------
def test_random_and_shared_prefix_requests() -> None:
    source = TokenSource()
    reqs = random_requests(source, 50, 40, 10, range_ratio=0.5, seed=1)
    assert all(20 <= r.prompt_len == len(r.prompt) <= 60 and 5 <= r.output_len <= 15 for r in reqs)  # type: ignore[operator, arg-type]
    assert all(SAFE_IDS[0] <= t < SAFE_IDS[1] for r in reqs for t in r.prompt)  # type: ignore[operator]
    assert len({r.prompt_len for r in reqs}) > 1
    shared = random_requests(source, 4, 8, 3, prefix_len=32, seed=1)
    assert all(r.prompt[:32] == shared[0].prompt[:32] and r.prompt_len == 40 for r in shared)
    assert len({tuple(r.prompt[32:]) for r in shared}) == 4
    chat = random_requests(source, 3, 12, 3, prefix_len=4, text=True, seed=1)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 16 and r.prompt_len is None for r in chat)
    assert random_requests(source, 3, 12, 3, seed=1) == random_requests(source, 3, 12, 3, seed=1)


def test_jsonl_requests(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 5}\n\n{"prompt": [30, 31, 32]}\n')
    reqs = jsonl_requests(path, None, 7, TokenSource())
    assert reqs == [BenchRequest("hello there", None, 5), BenchRequest([30, 31, 32], 3, 7)]
    assert [r.output_len for r in jsonl_requests(path, 5, 7, TokenSource())] == [5, 7, 5, 7, 5]  # reused in order
    with pytest.raises(ValueError, match="need --tokenizer"):
        jsonl_requests(path, None, 7, TokenSource(), chat=True)
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        jsonl_requests(path, None, 7, TokenSource())


# -- the SSE client on canned streams ----------------------------------------------------------
def _sse(*events: Any) -> bytes:
    return b"".join(f"id: {i}\ndata: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for i, e in enumerate(events, 1))


def _send(
    status: int, body: bytes, content_type: str = "text/event-stream", request: dict[str, Any] | None = None
) -> RequestResult:
    """`send_request` against a real HTTP server that answers one canned response."""

    async def go() -> RequestResult:
        async def handler(_: web.Request) -> web.Response:
            return web.Response(status=status, body=body, content_type=content_type)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                return await send_request(session, f"http://127.0.0.1:{port}/v1/chat/completions", request or {})
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_client_reads_chunks_and_usage() -> None:
    def delta(content: str | None, finish: str | None = None) -> dict[str, Any]:
        d = {} if content is None else {"content": content}
        return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}], "usage": None}

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    stream = _sse(role, delta("a"), delta("b"), delta("c"), delta(None, "length"), usage, "[DONE]")
    body = request_body("chat", "m", "hi", 4, ignore_eos=True)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    r = _send(200, stream, request=body)
    # The role-only chunk is not the first token; the finish chunk is one more output chunk.
    assert r.success and r.text == "abc" and r.chunks == 4 and len(r.itl) == 3
    assert (r.prompt_tokens, r.output_tokens) == (9, 4)
    assert 0 < r.ttft <= r.latency

    failed = _send(200, _sse(delta("a"), {"error": {"message": "engine died"}}), request=body)
    assert not failed.success and failed.error == "engine died"
    rejected = _send(400, json.dumps({"error": {"message": "too long"}}).encode(), "application/json", body)
    assert not rejected.success and rejected.error.startswith("HTTP 400") and "too long" in rejected.error
    assert "ignore_eos" not in request_body("completions", "m", [1, 2], 4, ignore_eos=False)


def test_events_split_anywhere_across_reads_parse_the_same() -> None:
    """The client parses whatever each read brings: an event cut at any byte, several events in
    one read, CRLF line ends (allowed by the SSE spec) all give the same text, counts and usage."""
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("x", "ü", "z")]
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    stream = _sse(*chunks, usage, "[DONE]")
    rng = random.Random(0)
    for body in (stream, stream.replace(b"\n", b"\r\n")):
        for _ in range(20):
            result = RequestResult()
            events = SseEvents(result, 0.0)
            cuts = sorted(rng.sample(range(1, len(body)), 6))
            for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(body)]), start=1):
                events.feed(body[a:b], float(k))
            assert (result.text, result.chunks, result.output_tokens) == ("xüz", 3, 3)
            assert events.done_at > 0 and len(result.itl) == 2 and result.ttft > 0


def test_python_m_bench_serve_is_the_command() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.serve", "--help"], capture_output=True, text=True, check=True)
    assert "conveyor bench serve" in out.stdout and "--request-rate" in out.stdout


# -- whole runs against a real stack -----------------------------------------------------------
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 16, 6


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model(), Path(tmp_path_factory.mktemp("bench-serve")), executor_args=("--num-blocks", "256"))
    s.start()
    yield s
    s.stop()


def _bench(stack: Stack, result_file: Path, *args: str) -> dict[str, Any]:
    from bench.serve import main

    assert (
        main(
            ["--base-url", stack.urls[0], "--disable-tqdm", "--request-timeout", "120", "--result-file", str(result_file), *args]
        )
        == 0
    )
    result = json.loads(result_file.read_text())
    missing = [f for f in FIELDS if not isinstance(result.get(f), (int, float))]
    assert not missing, missing
    return result


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("dataset", ["random", "jsonl"])
@pytest.mark.parametrize("rate", [None, "40"])
def test_bench_against_stack(stack: Stack, tmp_path: Path, endpoint: str, dataset: str, rate: str | None) -> None:
    args = ["--endpoint", endpoint, "--num-prompts", str(NUM_PROMPTS), "--ignore-eos", "--seed", "5"]
    if rate is not None:
        args += ["--request-rate", rate, "--max-concurrency", "3"]
    if dataset == "jsonl":
        lines = [
            {"prompt": "def hello(", "output_len": 3},
            {"prompt": "import os\nimport sys\n"},
            {"prompt": "class Foo:", "output_len": 9},
        ]
        if endpoint == "completions":
            lines.append({"prompt": list(range(40, 40 + INPUT_LEN)), "output_len": 4})
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        args += ["--dataset", str(path), "--random-output-len", str(OUTPUT_LEN)]
        wanted = sum(lines[i % len(lines)].get("output_len", OUTPUT_LEN) for i in range(NUM_PROMPTS))
    else:
        args += ["--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN)]
        wanted = NUM_PROMPTS * OUTPUT_LEN
    result = _bench(stack, tmp_path / "result.json", *args)
    assert (result["completed"], result["failed"], result["errors"]) == (NUM_PROMPTS, 0, [])
    assert result["total_output_tokens"] == wanted  # --ignore-eos: exactly what was asked for
    assert result["num_prompts"] == NUM_PROMPTS
    assert result["request_rate"] == ("inf" if rate is None else float(rate))
    if endpoint == "completions" and dataset == "random":  # token-id prompts: the server counts them as sent
        assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    else:
        assert result["total_input_tokens"] > NUM_PROMPTS  # the server's count of text and chat templates
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0 and result["p99_e2el_ms"] >= result["mean_ttft_ms"]
    assert "service_steps" not in result  # no --redis-url


def test_shared_prefix_with_engine_steps_and_model_by_path(stack: Stack, tiny_model: Any, tmp_path: Path) -> None:
    result = _bench(
        stack,
        tmp_path / "result.json",
        "--dataset",
        "shared-prefix",
        "--random-prefix-len",
        "32",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--num-prompts",
        "6",
        "--ignore-eos",
        "--model",
        str(tiny_model()),
        "--redis-url",
        stack.redis_url,
        "--namespace",
        stack.namespace,
    )
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (6, 6 * 40, 24)
    assert result["model_id"] == Path(tiny_model()).name  # the served name, found from the checkpoint path
    steps = result["service_steps"]
    assert steps["steps"] > 0 and steps["step_ms"] >= steps["execute_ms"] > 0


def test_failed_requests_are_counted(stack: Stack, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": [50] * 8, "output_len": 2}) + "\n" + json.dumps({"prompt": [5000] * 8}) + "\n"
    )  # outside the 1024-id vocabulary: a 400
    result = _bench(stack, tmp_path / "result.json", "--dataset", str(path), "--num-prompts", "4", "--ignore-eos")
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 2, 4)
    assert len(result["errors"]) == 2 and all(e.startswith("HTTP 400") for e in result["errors"])


def test_wrong_model_fails_fast(stack: Stack, tmp_path: Path) -> None:
    from bench.serve import main

    out = tmp_path / "result.json"
    assert (
        main(
            [
                "--base-url",
                stack.urls[0],
                "--model",
                "no-such-model",
                "--disable-tqdm",
                "--num-prompts",
                "2",
                "--result-file",
                str(out),
            ]
        )
        == 1
    )
    assert not out.exists()


def test_conveyor_bench_serve_start_offline(tiny_model: Any, tmp_path: Path) -> None:
    """``--start`` brings its own stack: CPU seconds per process, engine steps, and --offline's
    ratio; ``--repeat 2``: two whole rounds (a fresh stack each), their ratios, median and best.
    With ``--cpu-placement auto`` the executor runs on CPUs of its own, where there are enough."""
    from infra.cli import main
    from infra.cpu_placement import allowed_cpus, format_cpus, plan_placement

    cpus_before = allowed_cpus()

    out = tmp_path / "result.json"
    assert (
        main(
            [
                "bench",
                "serve",
                "--start",
                "--model",
                str(tiny_model()),
                "--num-blocks",
                "256",
                "--offline",
                "--cpu-placement",
                "auto",
                "--repeat",
                "2",
                "--num-prompts",
                "4",
                "--random-input-len",
                "8",
                "--random-output-len",
                "4",
                "--ignore-eos",
                "--disable-tqdm",
                "--request-timeout",
                "120",
                "--result-file",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert (result["completed"], result["total_output_tokens"]) == (4, 16)
    assert {"executor0", "scheduler0", "gateway0", "client"} <= set(result["cpu_s"])
    assert result["service_steps"]["steps"] > 0
    assert result["offline"]["output_tokens"] == 16 and result["http_vs_offline"] > 0
    plan = plan_placement(allowed_cpus(), 1)
    if plan is not None:
        assert result["cpus"] == {"executor": format_cpus(plan.executors[0]), "control": format_cpus(plan.control)}
    assert allowed_cpus() == cpus_before  # the load and the in-process run gave this process its CPUs back
    rounds = result["rounds"]
    assert len(rounds["output_throughput"]) == len(rounds["offline_tokens_per_s"]) == len(rounds["http_vs_offline"]) == 2
    assert rounds["http_vs_offline"][-1] == result["http_vs_offline"]  # the report is the last round's
    assert min(rounds["http_vs_offline"]) <= rounds["http_vs_offline_median"] <= max(rounds["http_vs_offline"])
    assert rounds["http_vs_offline_best"] == max(rounds["output_throughput"]) / max(rounds["offline_tokens_per_s"])
