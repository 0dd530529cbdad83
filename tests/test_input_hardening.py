"""One request never hurts another: bad or huge input gets a 400 (never a 500), keeps its
keep-alive connection, and does not stall the gateway for anyone else.

Against a real gateway process (`conveyor gateway`) on real Redis, with the engine played by an
`EngineStatus` key as in `tests/test_gateway_validation.py`; no request here reaches an engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common.protocol import Names
from common.sampling_params import SamplingParams
from gateway.openai.chat_messages import MAX_CONTENT_PARTS, MAX_MESSAGES
from gateway.openai.json_input import MAX_JSON_DEPTH
from gateway.openai.schema import MAX_STOP_STRING_CHARS
from infra.launcher import free_port, stop_all, wait_healthy
from infra.stack import REPO, find_redis
from tests.test_gateway_validation import MAX_MODEL_LEN, VOCAB_SIZE, register_engine

pytestmark = pytest.mark.stack

MAX_BODY_BYTES = 16 * 1024 * 1024
LONG_CONTEXT = 1_000_000
HEALTH_LIMIT_S = 0.1  # what /health may take while a huge prompt is being processed


@contextlib.contextmanager
def _gateway_process(workdir: Path, model: Path, max_model_len: int) -> Iterator[str]:
    """Base URL of a `conveyor gateway` process with a 16 MiB body limit, its tokenizer loaded,
    in front of a (played) engine of ``max_model_len`` tokens."""
    url, redis_proc = find_redis(workdir)
    r = redis.Redis.from_url(url)
    names = Names(f"test-hard-{uuid.uuid4().hex[:10]}")
    register_engine(r, names, model, max_model_len)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = workdir / f"gateway-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infra.cli",
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--redis-url",
                url,
                "--namespace",
                names.namespace,
                "--model",
                str(model),
                "--max-body-bytes",
                str(MAX_BODY_BYTES),
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(f"{base}/health", 60, [proc])
        # Tokenized, then rejected: the tokenizer is loaded before any test measures anything.
        warm = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "stop_token_ids": [VOCAB_SIZE]}, timeout=60)
        assert warm.status_code == 400, warm.text
        yield base
    finally:
        stop_all([proc])
        print(log_path.read_text(errors="replace")[-3000:])
        for key in r.scan_iter(match=f"{names.namespace}:*"):
            r.delete(key)
        if redis_proc is not None:
            redis_proc.terminate()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> Iterator[str]:
    with _gateway_process(tmp_path_factory.mktemp("hardening"), tiny_model(), MAX_MODEL_LEN) as base:
        yield base


@pytest.fixture(scope="module")
def long_context_gateway(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> Iterator[str]:
    """A gateway whose engine takes a million tokens: a 7 MB prompt is counted far into it."""
    with _gateway_process(tmp_path_factory.mktemp("hardening-long"), tiny_model(), LONG_CONTEXT) as base:
        yield base


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _huge_body(kind: str) -> bytes:
    words = "the quick brown fox jumps over the lazy dog and keeps on running "
    if kind == "text":  # ~7 MB of prose
        return json.dumps({"prompt": words * (7_000_000 // len(words)), "max_tokens": 1}).encode()
    if kind == "token_ids":  # ~7 MB of token ids
        return json.dumps({"prompt": list(range(1, 1000)) * 1400, "max_tokens": 1}).encode()
    assert kind == "chat"
    return json.dumps({"messages": [{"role": "user", "content": words * (2_000_000 // len(words))}]}).encode()


def _health_during(gateway: str, path: str, body: bytes) -> tuple[httpx.Response, float, list[float]]:
    """Post ``body`` and call /health back to back meanwhile: the post's response and seconds,
    and the latency of every /health call made while it ran."""
    result: dict[str, Any] = {}

    def post() -> None:
        t0 = time.perf_counter()
        result["response"] = httpx.post(
            f"{gateway}{path}", content=body, timeout=300, headers={"content-type": "application/json"}
        )
        result["seconds"] = time.perf_counter() - t0

    latencies: list[float] = []
    with httpx.Client(base_url=gateway, timeout=10) as client:
        client.get("/health")  # connected before the clock starts
        thread = threading.Thread(target=post)
        thread.start()
        while thread.is_alive():
            t0 = time.perf_counter()
            status = client.get("/health").status_code
            latencies.append(time.perf_counter() - t0)
            assert status == 200
            time.sleep(0.005)  # dense enough for several samples even when the request is quick
    thread.join()
    return result["response"], result["seconds"], latencies


@pytest.mark.parametrize(
    "kind, server", [("text", "gateway"), ("token_ids", "gateway"), ("chat", "gateway"), ("text", "long_context_gateway")]
)
def test_health_answers_fast_while_a_huge_prompt_is_processed(request: pytest.FixtureRequest, kind: str, server: str) -> None:
    gateway = request.getfixturevalue(server)
    body = _huge_body(kind)  # encoded up front: only the server's work overlaps the measurement
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    limit = LONG_CONTEXT if server == "long_context_gateway" else MAX_MODEL_LEN
    # A gateway that blocks its event loop on a huge prompt does so every time; a busy machine
    # (other processes on few cores) delays a call now and then. So: up to three tries.
    for _ in range(3):
        response, seconds, latencies = _health_during(gateway, path, body)
        err = _error(response)
        assert err["code"] == "context_length_exceeded" and f"context length is {limit} tokens" in err["message"], err
        print(
            f"\n/health during a {len(body) / 1e6:.1f} MB {kind} request to {server} ({seconds:.2f} s): "
            f"{len(latencies)} calls, median {statistics.median(latencies) * 1000:.1f} ms, "
            f"max {max(latencies) * 1000:.1f} ms"
        )
        assert len(latencies) >= 5, "the request finished before /health could be measured alongside it"
        if max(latencies) < HEALTH_LIMIT_S:
            break
    else:
        pytest.fail(f"/health took up to {max(latencies) * 1000:.0f} ms while a huge prompt was processed")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BIG = [2**31, 2**63, 2**64, 2**64 + 1, 10**30]

# (endpoint, raw JSON body, expected param, a word of the message)
BAD_INPUTS: list[tuple[str, str, str | None, str]] = [
    # not JSON, or JSON that no request can hold
    ("completions", '{"prompt": "x", "temperature": NaN}', None, "not valid JSON"),
    ("completions", '{"prompt": "x", "temperature": Infinity}', None, "not valid JSON"),
    ("completions", '{"prompt": "x", "seed": 1' + "0" * 5000 + "}", None, "not valid JSON"),
    ("completions", _nested(3000), None, f"more than {MAX_JSON_DEPTH} levels"),
    ("completions", '{"prompt": "x", "extra": ' + _nested(MAX_JSON_DEPTH) + "}", "extra", "levels"),
    ("completions", '{"prompt": "x", "extra": ' + '{"a": ' * 70 + "1" + "}" * 71, "extra", "levels"),
    # lone surrogates anywhere
    ("completions", '{"prompt": "a\\ud800b"}', "prompt", "lone surrogate \\ud800"),
    ("completions", '{"prompt": ["\\udfff"]}', "prompt", "surrogate"),
    ("completions", '{"prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop", "surrogate"),
    ("completions", '{"prompt": "x", "model": "\\ud800"}', "model", "surrogate"),
    ("completions", '{"\\ud800": 1, "prompt": "x"}', None, "surrogate"),
    ("completions", '"\\ud800"', None, "surrogate"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "messages", "surrogate"),
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages",
        "surrogate",
    ),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}', "stop", "surrogate"),
    # integers out of range
    *[("completions", f'{{"prompt": "x", "max_tokens": {v}}}', "max_tokens", "max_tokens") for v in BIG],
    *[("completions", f'{{"prompt": "x", "seed": {v}}}', "seed", "seed") for v in BIG[1:] + [-(2**63) - 1]],
    *[("completions", f'{{"prompt": "x", "top_k": {v}}}', "top_k", "top_k") for v in BIG],
    *[("completions", f'{{"prompt": "x", "min_tokens": {v}}}', "min_tokens", "min_tokens") for v in BIG],
    *[("completions", f'{{"prompt": "x", "logprobs": {v}}}', "logprobs", "logprobs") for v in BIG],
    *[("completions", f'{{"prompt": "x", "n": {v}}}', "n", "n must be") for v in BIG],
    *[("completions", f'{{"prompt": [1, {v}]}}', "prompt", f"[0, {VOCAB_SIZE})") for v in [VOCAB_SIZE] + BIG],
    *[
        ("completions", f'{{"prompt": "x", "stop_token_ids": [2, {v}]}}', "stop_token_ids", "stop_token_ids")
        for v in [VOCAB_SIZE, -1] + BIG
    ],
    *[
        (
            "chat/completions",
            f'{{"messages": [{{"role": "user", "content": "x"}}], "logprobs": true, "top_logprobs": {v}}}',
            "top_logprobs",
            "top_logprobs",
        )
        for v in BIG
    ],
    *[
        (
            "chat/completions",
            f'{{"messages": [{{"role": "user", "content": "x"}}], "max_completion_tokens": {v}}}',
            "max_tokens",
            "max_tokens",
        )
        for v in BIG
    ],
    ("completions", '{"prompt": "x", "temperature": 1e400}', "temperature", "temperature"),
    ("completions", '{"prompt": "x", "repetition_penalty": 1e400}', "repetition_penalty", "[0.01, 100.0]"),
    ("completions", '{"prompt": "x", "logit_bias": {"5": -1e400}}', "logit_bias", "[-100.0, 100.0]"),
    ("completions", '{"prompt": [-1]}', "prompt", "non-negative"),
    ("completions", '{"prompt": [1, true]}', "prompt", "token ids"),
    # sizes that would cost every other request
    ("completions", json.dumps({"prompt": "x", "stop": ["y" * (MAX_STOP_STRING_CHARS + 1)]}), "stop", "characters"),
    (
        "completions",
        json.dumps({"prompt": "x", "stop_token_ids": [1] * (SamplingParams.MAX_STOP_TOKEN_IDS + 1)}),
        "stop_token_ids",
        "at most",
    ),
    (
        "chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}),
        "messages",
        "at most",
    ),
    (
        "chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 3}] * (MAX_CONTENT_PARTS // 3 + 1)}
        ),
        "messages",
        "content parts",
    ),
    (
        "completions",
        json.dumps({"prompt": "x", "stop": 5, "logit_bias": {"1": list(range(100_000))}}),
        "logit_bias",
        "must be numbers",
    ),
    ("completions", json.dumps({"prompt": "x", "logit_bias": {"9" * 100_000: 1}}), "logit_bias", "token ids"),
]


@pytest.mark.parametrize(
    "endpoint, body, param, word", BAD_INPUTS, ids=[f"{i}-{case[2] or 'body'}" for i, case in enumerate(BAD_INPUTS)]
)
def test_malformed_input_is_a_400_in_openai_format(gateway: str, endpoint: str, body: str, param: str | None, word: str) -> None:
    response = httpx.post(
        f"{gateway}/v1/{endpoint}",
        content=body.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    err = _error(response)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert word in err["message"], err
    assert len(err["message"]) < 400, "an error message must not echo a huge input"


def test_valid_unicode_and_allowed_depth_pass_the_body_checks(gateway: str) -> None:
    """A surrogate pair (an emoji), unusual characters and nesting at the limit are fine: the
    request fails only on its max_tokens, checked after the body."""
    body = '{"prompt": "\\ud83d\\ude00 caf\\u00e9 \\u0000", "extra": ' + _nested(MAX_JSON_DEPTH - 1) + ', "max_tokens": 0}'
    err = _error(httpx.post(f"{gateway}/v1/completions", content=body, headers={"content-type": "application/json"}))
    assert err["param"] == "max_tokens"
    raw = '{"prompt": "\xed\xa0\x80"}'.encode("latin-1")  # a surrogate encoded as (invalid) UTF-8 bytes
    err = _error(httpx.post(f"{gateway}/v1/completions", content=raw, headers={"content-type": "application/json"}))
    assert "not valid" in err["message"]


def _local_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_errors_keep_the_keep_alive_connection(gateway: str) -> None:
    too_big = b"x" * (MAX_BODY_BYTES + 1)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        for i in range(0, len(too_big), 1 << 20):
            yield too_big[i : i + (1 << 20)]

    bad_requests: list[tuple[str, str, dict[str, Any], int]] = [
        ("POST", "/v1/completions", {"content": b'{"prompt": "x",'}, 400),
        ("POST", "/v1/completions", {"content": b'{"prompt": "\\ud800"}'}, 400),
        ("POST", "/v1/completions", {"content": _nested(3000).encode()}, 400),
        ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 2**64}}, 400),
        ("POST", "/v1/completions", {"json": {"prompt": [5] * 3000}}, 400),
        ("POST", "/v1/completions", {"json": {"model": "gpt-9", "prompt": "x"}}, 404),
        ("GET", "/v1/nothing", {}, 404),
        ("GET", "/v1/completions", {}, 405),
        ("POST", "/v1/completions", {"content": too_big}, 413),
        ("POST", "/v1/completions", {"content": chunks()}, 413),
    ]
    with httpx.Client(base_url=gateway, timeout=30) as client:
        port = _local_port(client.get("/health"))
        for method, path, kwargs, status in bad_requests:
            response = client.request(method, path, **kwargs)
            err = _error(response, status)
            assert response.headers.get("connection", "").lower() != "close", (path, err)
            if status == 405:
                assert "POST" in response.headers["allow"]
            # The next request rides the same connection: nothing was closed.
            assert _local_port(response) == port, (path, status)
            assert _local_port(client.get("/health")) == port, (path, status)


def test_unexpected_exception_is_a_json_500_on_the_same_connection(tiny_model: Any, tmp_path: Path) -> None:
    """An exception no handler expects: a JSON 500 without its text, and the connection stays."""
    import uvicorn

    from gateway.http.config import GatewayConfig
    from gateway.http.routes import create_app

    url, redis_proc = find_redis(tmp_path)
    names = Names(f"test-hard500-{uuid.uuid4().hex[:10]}")
    r = redis.Redis.from_url(url)
    register_engine(r, names, tiny_model())
    app = create_app(GatewayConfig(redis_url=url, namespace=names.namespace, gateway_id="gw500"))

    async def boom() -> None:
        raise RuntimeError("internal detail for the log only")

    app.add_api_route("/test/boom", boom)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", 30, [])
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            port0 = _local_port(client.get("/health"))
            for _ in range(2):
                response = client.get("/test/boom")
                err = _error(response, 500)
                assert err["type"] == "server_error" and "RuntimeError" in err["message"], err
                assert "detail" not in err["message"]
                assert _local_port(response) == port0
            assert _local_port(client.get("/health")) == port0
    finally:
        server.should_exit = True
        thread.join(10)
        for key in r.scan_iter(match=f"{names.namespace}:*"):
            r.delete(key)
        if redis_proc is not None:
            redis_proc.terminate()
