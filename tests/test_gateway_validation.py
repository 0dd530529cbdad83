"""Gateway request validation and error format, against real Redis with no engine behind it.

The engine side is played by the test: an `EngineStatus` key (`register_engine`) makes the
gateway believe a scheduler with an executor is up; for the one request that gets through, a
thread reads the engine's requests stream and writes `StepOutputs` back, as the scheduler would.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from common.protocol import AbortRequests, EngineStatus, GenerateRequest, Names, StepOutputs, decode, encode
from common.sampling_params import sampling_from_dict
from gateway.http.config import GatewayConfig
from gateway.http.routes import create_app
from gateway.openai.schema import parse_chat
from infra.launcher import free_port
from infra.stack import find_redis

pytestmark = pytest.mark.stack

MAX_MODEL_LEN = 2048
VOCAB_SIZE = 1024
ENGINE = "s0"  # the scheduler id the test plays


def register_engine(
    r: redis.Redis, names: Names, model: str | Path, max_model_len: int = MAX_MODEL_LEN, scheduling_policy: str = "fcfs"
) -> None:
    """Make gateways see one live engine (scheduler ``ENGINE`` with an executor) serving ``model``."""
    status = EngineStatus(
        ENGINE, "i0", "tiny", str(model), max_model_len, VOCAB_SIZE, 16, 64, "e0", 1, 64, 0, 0, 0, 0, 0, time.time()
    )
    status.scheduling_policy = scheduling_policy
    r.zadd(names.engines, {ENGINE: time.time()})
    r.set(names.engine(ENGINE), encode(status), px=600_000)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> Iterator[dict[str, Any]]:
    workdir = Path(tmp_path_factory.mktemp("gw"))
    model = tiny_model()
    url, proc = find_redis(workdir)
    r = redis.Redis.from_url(url)
    names = Names(f"test-gw-{time.time_ns()}")
    register_engine(r, names, model)
    config = GatewayConfig(redis_url=url, namespace=names.namespace, gateway_id="gw0", max_body_bytes=20000)
    with TestClient(create_app(config)) as client:
        deadline = time.time() + 60
        while client.get("/health").status_code != 200 and time.time() < deadline:  # the tokenizer loads
            time.sleep(0.05)
        yield {"client": client, "redis": r, "names": names, "model": model}
    for key in r.scan_iter(match=f"{names.namespace}:*"):
        r.delete(key)
    if proc is not None:
        proc.terminate()


def _error(response: Any, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for word in words:
        assert word in err["message"], err
    return err


def test_malformed_json_and_non_object(env: dict[str, Any]) -> None:
    c = env["client"]
    _error(
        c.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}), 400, "not valid JSON"
    )
    _error(c.post("/v1/completions", json=[1, 2]), 400, "JSON object")


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens", ["integer"]),
        ({"prompt": "hi", "temperature": "hot"}, "temperature", ["number"]),
        ({"prompt": "hi", "stream": "yes"}, "stream", ["boolean"]),
        ({"prompt": "hi", "max_tokens": -5}, "max_tokens", ["at least 1", "-5"]),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ["at least 1"]),
        ({"prompt": "hi", "top_p": 0}, "top_p", ["top_p"]),
        ({"prompt": "hi", "logprobs": 50}, "logprobs", ["logprobs"]),
        ({"prompt": "hi", "stop": [1, 2]}, "stop", ["stop"]),
        ({"prompt": "hi", "n": 0}, "n", ["n must be", "[1, 128]"]),
        ({"prompt": "hi", "n": 200}, "n", ["n must be", "200"]),
        ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of", ["best_of must be", "n = 2"]),
        ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of", ["stream"]),
        ({"prompt": ["a", 5]}, "prompt", ["strings"]),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens", ["min_tokens"]),
        ({"prompt": ""}, "prompt", ["empty"]),
        ({"max_tokens": 3}, "prompt", ["required"]),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", ["[-2.0, 2.0]", "2.5"]),
        ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", ["[-2.0, 2.0]", "-3"]),
        ({"prompt": "hi", "frequency_penalty": "high"}, "frequency_penalty", ["number"]),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", ["[0.01, 100.0]"]),
        ({"prompt": "hi", "repetition_penalty": 2**64}, "repetition_penalty", ["[0.01, 100.0]"]),  # not a 500
        ({"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty", ["[0.01, 100.0]"]),  # not NaN logits
        ({"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias", ["object"]),
        ({"prompt": "hi", "logit_bias": {"dog": 1}}, "logit_bias", ["token ids", "dog"]),
        ({"prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias", ["token ids"]),
        ({"prompt": "hi", "logit_bias": {"5": "up"}}, "logit_bias", ["numbers"]),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", ["[-100.0, 100.0]", "101"]),
        ({"prompt": "hi", "logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias", [f"[0, {VOCAB_SIZE})", "vocabulary"]),
        ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", ["at most 1024"]),
    ],
)
def test_bad_parameters(env: dict[str, Any], body: dict[str, Any], param: str, words: list[str]) -> None:
    err = _error(env["client"].post("/v1/completions", json=body), 400, *words)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_context_length_errors_say_both_numbers(env: dict[str, Any]) -> None:
    c = env["client"]
    err = _error(c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10**6}), 400, str(MAX_MODEL_LEN), str(10**6))
    assert err["code"] == "context_length_exceeded"
    err = _error(
        c.post("/v1/completions", json={"prompt": [5] * 3000, "max_tokens": 1}), 400, "3000 in the prompt", str(MAX_MODEL_LEN)
    )
    assert err["param"] == "prompt"
    _error(c.post("/v1/completions", json={"prompt": [5, 99999]}), 400, "token ids")


def test_chat_validation(env: dict[str, Any]) -> None:
    c = env["client"]
    _error(c.post("/v1/chat/completions", json={"messages": []}), 400, "non-empty")
    _error(c.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]}), 400, "role")
    _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}), 400, "content")
    _error(
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400, "requires"
    )


def test_chat_min_tokens_without_max_tokens_is_valid() -> None:
    """Chat's ``max_tokens`` defaults to the rest of the context, known only with the prompt: a
    ``min_tokens`` above 1 is valid without it (not checked against a stand-in of 1)."""
    spec = parse_chat({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5})
    assert spec.max_tokens is None and spec.sampling.min_tokens == 5


@pytest.mark.parametrize(
    "field",
    [
        {"chat_template": "{{ messages }}"},
        {"documents": [{"title": "a", "text": "b"}]},
    ],
)
def test_chat_template_fields_it_cannot_honour_are_refused(env: dict[str, Any], field: dict[str, Any]) -> None:
    """They were ignored: a client asking for another template got the default one and a 200."""
    (name,) = field
    body = {"messages": [{"role": "user", "content": "hi"}], **field}
    err = _error(env["client"].post("/v1/chat/completions", json=body), 400, "not supported")
    assert err["param"] == name
    parse_chat({"messages": [{"role": "user", "content": "hi"}], name: None})  # null is fine


def test_unknown_model_body_too_large_and_unknown_route(env: dict[str, Any]) -> None:
    c = env["client"]
    err = _error(c.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "gpt-9")
    assert err["code"] == "model_not_found"
    _error(c.post("/v1/completions", json={"prompt": "x" * 25000}), 413, "20000")
    _error(c.get("/v1/nothing"), 404)
    err = _error(c.get("/v1/streams/" + "x" * 10_000), 404, "no resumable stream")
    assert err["code"] == "stream_not_found" and len(err["message"]) < 200  # the id is cut, as other echoes are


def test_models_and_health(env: dict[str, Any]) -> None:
    c = env["client"]
    data = c.get("/v1/models").json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["max_model_len"] == MAX_MODEL_LEN
    assert c.get("/health").status_code == c.get("/ping").status_code == c.post("/ping").status_code == 200
    assert c.get("/v1/models/tiny").json() == data[0]
    assert c.get(f"/v1/models/{env['model']}").json() == data[0]  # the path it was loaded from works too
    err = _error(c.get("/v1/models/gpt-9"), 404, "gpt-9")
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error"
    version = c.get("/version").json()["version"]
    assert version == importlib.metadata.version("conveyor")


def _fake_engine(
    r: redis.Redis,
    names: Names,
    texts: list[str],
    tokenizer_path: str,
    after: bytes | str = "0",
    stop_token: int | None = None,
    seen: list[GenerateRequest] | None = None,
) -> threading.Thread:
    """Answer the next request on the stream (after entry ``after``) with the tokens of ``texts``,
    one output per text; the last ends with "length", or with ``stop_token`` appended as a stop
    token id. The request is appended to ``seen``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def run() -> None:
        reply = r.xread({names.requests(ENGINE): after}, block=10_000, count=1)
        req = decode(reply[0][1][0][1][b"m"], (GenerateRequest,))
        if seen is not None:
            seen.append(req)
        index = 0
        for i, text in enumerate(texts):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            last = i == len(texts) - 1
            out = StepOutputs(
                [req.request_id], [index], [len(ids)], ids, [last], ["length" if last else None], [None], [], [], []
            )
            if last and stop_token is not None:
                out = StepOutputs()
                out.add(req.request_id, index, ids + [stop_token], None, True, "stop", stop_reason=stop_token)
            r.xadd(names.outputs(req.gateway_id), {b"m": encode(out.sealed())})
            index += len(ids)
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_stream_stop_string_aborts_in_engine(env: dict[str, Any]) -> None:
    c, r, names = env["client"], env["redis"], env["names"]
    requests_before = r.xlen(names.requests(ENGINE))
    thread = _fake_engine(r, names, ["Hello wor", "ld! END", " of", " text"], str(env["model"]))
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stop": ["END"], "stream_options": {"include_usage": True}}
    with c.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    thread.join(5)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == "Hello world! "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    # The gateway told the scheduler to stop generating (on its requests stream, after the request).
    deadline = time.time() + 2
    while r.xlen(names.requests(ENGINE)) <= requests_before + 1 and time.time() < deadline:
        time.sleep(0.02)
    entries = r.xrange(names.requests(ENGINE))
    aborts = [decode(e[b"m"], (AbortRequests,)) for _, e in entries[requests_before + 1 :]]
    assert any(chunks[0]["id"] in a.request_ids for a in aborts)


def test_penalties_and_logit_bias_reach_the_engine_and_stop_reason_comes_back(env: dict[str, Any]) -> None:
    """The parameters arrive in the scheduler's `GenerateRequest` (``logit_bias`` with integer
    ids, as pairs on the wire); a stop token id the engine reports is the choice's ``stop_reason``
    (non-streaming, and on the final streaming chunk only)."""
    c, r, names = env["client"], env["redis"], env["names"]
    body = {
        "prompt": "hi",
        "max_tokens": 20,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.1,
        "logit_bias": {"7": -100, "12": 5.5},
    }
    seen: list[GenerateRequest] = []
    for stream in (False, True):
        last = (r.xrevrange(names.requests(ENGINE), count=1) or [(b"0", None)])[0][0]
        thread = _fake_engine(r, names, ["Hello", " world"], str(env["model"]), last, stop_token=9, seen=seen)
        response = c.post("/v1/completions", json={**body, "stream": stream})
        thread.join(5)
        assert response.status_code == 200, response.text
        if not stream:
            choice = response.json()["choices"][0]
            assert choice["text"].startswith("Hello world") and choice["finish_reason"] == "stop"
            assert choice["stop_reason"] == 9
            continue
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert [ch["choices"][0]["stop_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + [9]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    for req in seen:
        params = sampling_from_dict(req.sampling)
        assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1, 1.1)
        assert params.logit_bias == {7: -100, 12: 5.5}


def test_engine_down_gives_503(env: dict[str, Any]) -> None:
    c, r, names = env["client"], env["redis"], env["names"]
    r.delete(names.engine(ENGINE))
    deadline = time.time() + 3
    while c.get("/health").status_code == 200 and time.time() < deadline:
        time.sleep(0.1)
    _error(c.get("/health"), 503, "no engine")
    _error(c.post("/ping"), 503, "no engine")  # (vLLM's alias)
    _error(c.post("/v1/completions", json={"prompt": "hi"}), 503, "engine unavailable")
    register_engine(r, names, env["model"])


def test_a_redis_refusing_writes_gives_503s_not_500s(env: dict[str, Any]) -> None:
    """Out of memory (``maxmemory`` reached, nothing to evict): a submission and a resume are 503s
    with Retry-After, and the gateway serves again once Redis has memory."""
    c, r = env["client"], env["redis"]
    deadline = time.time() + 5
    while c.get("/health").status_code != 200 and time.time() < deadline:  # an engine (another test took it away)
        time.sleep(0.1)
    before = r.config_get("maxmemory")["maxmemory"]
    r.config_set("maxmemory", 1)
    try:
        for response in (
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}),
            # A client's id is claimed first: refused, that is no "id taken" (409)
            c.post("/v1/completions", json={"prompt": "hi", "stream": True}, headers={"X-Request-Id": "mine-1"}),
        ):
            _error(response, 503, "Redis")
            assert response.headers["retry-after"] == "1"
    finally:
        r.config_set("maxmemory", before)
    assert c.get("/health").status_code == 200


def test_health_is_503_until_the_tokenizer_loads(tmp_path: Path) -> None:
    """A gateway is ready only once requests need not wait for the tokenizer (a load balancer and
    the test stack wait on /health); a tokenizer that cannot load keeps it 503 with the reason."""
    url, proc = find_redis(tmp_path)
    r = redis.Redis.from_url(url)
    names = Names(f"test-gw-{time.time_ns()}")
    register_engine(r, names, tmp_path / "no-such-model")
    config = GatewayConfig(redis_url=url, namespace=names.namespace, gateway_id="gw1")
    try:
        with TestClient(create_app(config)) as c:
            deadline = time.time() + 30
            while "could not load the tokenizer" not in c.get("/health").text and time.time() < deadline:
                time.sleep(0.1)
            err = _error(c.get("/health"), 503, "not ready", "could not load the tokenizer", "no-such-model")
            assert err["type"] == "server_error"
            # Not ready, no work taken: a 503 a load balancer retries elsewhere, not a request held here.
            for path, body in (
                ("/v1/completions", {"prompt": "hi"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                response = c.post(path, json=body)
                err = _error(response, 503, "not ready", "could not load the tokenizer")
                assert err["code"] == "not_ready" and response.headers["retry-after"] == "1"
    finally:
        for key in r.scan_iter(match=f"{names.namespace}:*"):
            r.delete(key)
        if proc is not None:
            proc.terminate()


def test_health_says_redis_is_unreachable_without_its_address(caplog: pytest.LogCaptureFixture) -> None:
    """The address of Redis is for the log, not for whoever asks /health."""
    port = free_port()  # nothing listens there
    config = GatewayConfig(redis_url=f"redis://127.0.0.1:{port}/0", namespace="test-gw-unreachable", gateway_id="gw1")
    with caplog.at_level("WARNING", "conveyor.gateway"), TestClient(create_app(config)) as c:
        deadline = time.time() + 30
        while "Redis unreachable" not in c.get("/health").text and time.time() < deadline:
            time.sleep(0.2)
        response = c.get("/health")
        _error(response, 503, "Redis unreachable")
        assert str(port) not in response.text and "127.0.0.1" not in response.text
        assert str(port) in caplog.text  # the detail is logged
