"""/tokenize and /detokenize, X-Request-Id (echo, engine id, duplicates) and the request log line,
through two real gateways (uvicorn on real ports, real HTTP) sharing a real Redis.

The engine is played by `FakeEngine`, a thread on the engine's requests stream: it answers each
request with its own prompt's tokens (so a response shows whose prompt it got), which makes
mixed-up outputs visible. The whole stack with a real model: `tests/test_services.py`.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common.logs import STRUCTURED, formatter
from common.protocol import AbortRequests, GenerateRequest, Names, StepOutputs, decode, encode
from common.redact import RedactingFilter
from gateway.http.config import GatewayConfig
from gateway.http.request_ids import MAX_REQUEST_ID_CHARS
from gateway.http.tenants import Tenant, tenant_id
from infra.launcher import free_port, wait_healthy
from infra.stack import find_redis
from tests.test_gateway_validation import ENGINE, MAX_MODEL_LEN, VOCAB_SIZE, _error, register_engine

pytestmark = pytest.mark.stack

API_KEY = "sk-extras-secret-1234"
HOLD_MAX_TOKENS = 77  # a request with this max_tokens stops after its first token until `FakeEngine.release`


class FakeEngine:
    """Plays scheduler `ENGINE`: answers every `GenerateRequest` with its prompt's ids after the
    first (an echo), one token per step, the last with finish reason ``length``; records requests
    and aborts."""

    def __init__(self, r: redis.Redis, names: Names) -> None:
        self.r, self.names = r, names
        self.seen: list[GenerateRequest] = []
        self.aborted: set[str] = set()
        self.release = threading.Event()
        self.stopped = threading.Event()
        last = r.xrevrange(names.requests(ENGINE), count=1)
        self.cursor: bytes | str = last[0][0] if last else "0-0"
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    @staticmethod
    def reply(prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        return prompt_token_ids[1:][:max_tokens]

    def _read(self) -> None:
        while not self.stopped.is_set():
            for _, entries in self.r.xread({self.names.requests(ENGINE): self.cursor}, block=100) or []:
                for entry_id, entry in entries:
                    self.cursor = entry_id
                    msg = decode(entry[b"m"])
                    if isinstance(msg, GenerateRequest):
                        self.seen.append(msg)
                        threading.Thread(target=self._answer, args=(msg,), daemon=True).start()
                    elif isinstance(msg, AbortRequests):
                        self.aborted.update(msg.request_ids)

    def _answer(self, req: GenerateRequest) -> None:
        max_tokens = int(req.sampling["max_tokens"])
        tokens = self.reply(req.prompt_token_ids, max_tokens)
        for i, token in enumerate(tokens):
            if req.request_id in self.aborted or self.stopped.is_set():
                return
            if i == 1 and max_tokens == HOLD_MAX_TOKENS:
                self.release.wait(30)
            last = i == len(tokens) - 1
            out = StepOutputs()
            out.add(req.request_id, i, [token], None, last, "length" if last else None)
            self.r.xadd(self.names.outputs(req.gateway_id), {b"m": encode(out.sealed())})
            time.sleep(0.01)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> Iterator[dict[str, Any]]:
    import uvicorn
    from transformers import AutoTokenizer

    from gateway.http.routes import create_app

    model = tiny_model()
    work = Path(tmp_path_factory.mktemp("extras"))
    url, proc = find_redis(work)
    # A copy of the checkpoint whose generation config sets sampling defaults, as Qwen3's does,
    # for gateway C ("auto") and D (vLLM's "vllm": OpenAI's defaults).
    sampled = work / "sampled-model"
    shutil.copytree(model, sampled)
    generation = json.loads((sampled / "generation_config.json").read_text())
    (sampled / "generation_config.json").write_text(json.dumps({**generation, **SAMPLING_DEFAULTS, "min_p": -1}))
    r = redis.Redis.from_url(url)
    names = Names(f"test-extras-{uuid.uuid4().hex[:10]}")
    register_engine(r, names, model)
    engine = FakeEngine(r, names)
    servers, threads, clients, apps = [], [], [], []
    for gateway_id, options in (
        ("gwA", {}),
        ("gwB", {}),
        ("gwC", {"model": str(sampled)}),
        ("gwD", {"model": str(sampled), "generation_config": "vllm"}),
    ):
        config = GatewayConfig(redis_url=url, namespace=names.namespace, gateway_id=gateway_id, api_keys=(API_KEY,), **options)
        port = free_port()
        apps.append(create_app(config))
        server = uvicorn.Server(uvicorn.Config(apps[-1], host="127.0.0.1", port=port, log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        wait_healthy(f"http://127.0.0.1:{port}/health", 60, [])
        clients.append(
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"})
        )
    try:
        yield {
            "a": clients[0],
            "b": clients[1],
            "c": clients[2],
            "d": clients[3],
            "apps": apps,
            "redis": r,
            "names": names,
            "engine": engine,
            "tokenizer": AutoTokenizer.from_pretrained(model),
            "model": model,
        }
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.should_exit = True
        engine.release.set()
        engine.stop()
        for thread in threads:
            thread.join(10)
        for key in r.scan_iter(match=f"{names.namespace}:*"):
            r.delete(key)
        if proc is not None:
            proc.terminate()


SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def _engine_request(env: dict[str, Any], engine_prefix: str) -> GenerateRequest:
    found = [req for req in env["engine"].seen if req.request_id.startswith(engine_prefix)]
    assert len(found) == 1, [req.request_id for req in env["engine"].seen]
    return found[0]


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", response.text
    return [json.loads(line[6:]) for line in lines[:-1]]


# -- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_equal_the_tokenizer(env: dict[str, Any]) -> None:
    c, tok = env["a"], env["tokenizer"]
    text = "def hello(name):\n    return f'Hello, {name}!'  # ünïcode"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # add_special_tokens defaults to true for a prompt
    got = c.post("/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert got == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    plain = tok(text, add_special_tokens=False)["input_ids"]
    got = c.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert got["tokens"] == plain and got["token_strs"] == tok.convert_ids_to_tokens(plain)
    assert c.post("/tokenize", json={"model": str(env["model"]), "prompt": ""}).json()["tokens"] == tok("")["input_ids"]
    for tokens in (ids, plain, [], list(range(VOCAB_SIZE))):
        assert c.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": tok.decode(tokens)}
    assert c.post("/detokenize", json={"model": "tiny", "tokens": plain}).json()["prompt"] == tok.decode(plain) == text


def test_chat_tokenize_equals_what_the_chat_endpoint_counts(env: dict[str, Any]) -> None:
    c, tok = env["a"], env["tokenizer"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    got = c.post("/tokenize", json={"messages": messages}).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and got["count"] == len(got["tokens"])
    # What the chat endpoint sends the engine, and answers as usage.prompt_tokens.
    response = c.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, headers={"X-Request-Id": "chat-count-1"}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == got["count"]
    assert _engine_request(env, "chat-count-1-").prompt_token_ids == got["tokens"]
    # Content parts are joined as the chat endpoint joins them; the generation prompt is optional.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    assert (
        c.post("/tokenize", json={"messages": parts}).json()["tokens"]
        == c.post("/tokenize", json={"messages": [{"role": "user", "content": "Say hi"}]}).json()["tokens"]
    )
    bare = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    got = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False, "add_special_tokens": True}).json()
    assert got["tokens"] == tok(bare, add_special_tokens=True)["input_ids"]


def test_chat_template_options_reach_the_template(env: dict[str, Any]) -> None:
    """vLLM's ``continue_final_message`` (a prefilled answer the model goes on from) and
    ``chat_template_kwargs`` (the template's own variables, as Qwen3's ``enable_thinking``), on
    /tokenize and the chat endpoint alike; they were 400s."""
    c, tok = env["a"], env["tokenizer"]
    prefilled = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    text = tok.apply_chat_template(prefilled, tokenize=False, **options)
    assert text.endswith("The colour is")  # (no end-of-turn: the model writes on)
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert c.post("/tokenize", json={"messages": prefilled, **options}).json()["tokens"] == want
    response = c.post(
        "/v1/chat/completions", json={"messages": prefilled, "max_tokens": 2, **options}, headers={"X-Request-Id": "prefill-1"}
    )
    assert response.status_code == 200, response.text
    assert _engine_request(env, "prefill-1-").prompt_token_ids == want
    # vLLM's chat echo: the answer goes on from the prefilled message, streamed or not.
    echoed = c.post("/v1/chat/completions", json={"messages": prefilled, "max_tokens": 2, "echo": True, **options}).json()
    answer = echoed["choices"][0]["message"]["content"]
    assert answer.startswith("The colour is") and len(answer) > len("The colour is")
    with c.stream(
        "POST", "/v1/chat/completions", json={"messages": prefilled, "max_tokens": 2, "echo": True, "stream": True, **options}
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "The colour is"}
    # Not the assistant's turn last: nothing to go on from (vLLM's rule).
    plain = c.post("/v1/chat/completions", json={"messages": prefilled[:1], "max_tokens": 2, "echo": True}).json()
    assert not plain["choices"][0]["message"]["content"].startswith("Name a colour")
    # A template variable: the tiny checkpoint's template has none, so a copy of it gets one.
    thinking = tok.chat_template.replace(
        "{% if add_generation_prompt %}",
        "{% if enable_thinking is false %}[no thinking]{% endif %}{% if add_generation_prompt %}",
    )
    from gateway.openai.chat_messages import TemplateOptions, chat_text

    original, tok.chat_template = tok.chat_template, thinking
    try:
        off = chat_text(tok, prefilled[:1], TemplateOptions(kwargs={"enable_thinking": False}))
        assert "[no thinking]" in off and "[no thinking]" not in chat_text(tok, prefilled[:1], TemplateOptions())
    finally:
        tok.chat_template = original
    kwargs = {"messages": prefilled[:1], "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}
    assert c.post("/v1/chat/completions", json=kwargs).status_code == 200  # (a variable the template ignores)


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("/detokenize", {"tokens": [1, VOCAB_SIZE]}, 400, "tokens", [f"[0, {VOCAB_SIZE})", str(VOCAB_SIZE)]),
        ("/detokenize", {"tokens": [5, -1]}, 400, "tokens", ["non-negative", "-1"]),
        ("/detokenize", {"tokens": [5, "6"]}, 400, "tokens", ["integers", "'6'"]),
        ("/detokenize", {"tokens": [5, True]}, 400, "tokens", ["integers"]),
        ("/detokenize", {"tokens": [5, 2.0]}, 400, "tokens", ["integers"]),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens", ["array"]),
        ("/detokenize", {}, 400, "tokens", ["required"]),
        ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "tokens", [str(MAX_MODEL_LEN)]),
        ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model", ["gpt-9"]),
        ("/detokenize", [1, 2], 400, None, ["JSON object"]),
        ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model", ["gpt-9"]),
        ("/tokenize", {}, 400, "prompt", ["required"]),
        ("/tokenize", {"prompt": 5}, 400, "prompt", ["string"]),
        ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", ["string"]),
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt", ["not both"]),
        ("/tokenize", {"messages": []}, 400, "messages", ["non-empty"]),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", ["role"]),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"},
            400,
            "chat_template",
            ["not supported"],
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
            ["'add_generation_prompt': false"],
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True, "add_generation_prompt": False},
            400,
            "continue_final_message",
            ["last message", "assistant"],
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
            400,
            "chat_template_kwargs",
            ["may not set 'tokenize'"],
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a-b": 1}},
            400,
            "chat_template_kwargs",
            ["template variables"],
        ),
        ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, 400, "return_token_strs", ["boolean"]),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": 1}, 400, "add_special_tokens", ["boolean"]),
        ("/tokenize", {"prompt": "hello world " * 2000}, 400, "prompt", [str(MAX_MODEL_LEN), "tokens"]),
    ],
)
def test_tokenize_errors(env: dict[str, Any], path: str, body: Any, status: int, param: str | None, words: list[str]) -> None:
    err = _error(env["a"].post(path, json=body), status, *words)
    assert err["param"] == param
    if "hello world" in json.dumps(body):
        assert err["code"] == "context_length_exceeded"


def test_tokenize_needs_the_api_key(env: dict[str, Any]) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        for auth in ("", "Bearer wrong"):
            err = _error(env["a"].post(path, json=body, headers={"Authorization": auth}), 401, "API key")
            assert err["code"] == "invalid_api_key"


# -- X-Request-Id ----------------------------------------------------------------------------
def _completion(client: httpx.Client, prompt: str, request_id: str | None = None, **body: Any) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id is not None else {}
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, **body}, headers=headers)


def _expected_text(env: dict[str, Any], prompt: str, max_tokens: int = 5) -> str:
    tok = env["tokenizer"]
    return tok.decode(FakeEngine.reply(tok(prompt)["input_ids"], max_tokens), skip_special_tokens=True)


def test_x_request_id_is_the_response_id_and_the_engine_ids_prefix(env: dict[str, Any]) -> None:
    c = env["a"]
    response = _completion(c, "one two three four five six", "trace-0001")
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "trace-0001" and response.headers["x-request-id"] == "trace-0001"
    assert response.json()["choices"][0]["text"] == _expected_text(env, "one two three four five six")
    req = _engine_request(env, "trace-0001-")
    assert re.fullmatch(r"trace-0001-[0-9a-f]{8}", req.request_id), req.request_id
    # Streaming: every chunk has the id, the header too, and the journal is under it.
    with c.stream(
        "POST",
        "/v1/chat/completions",
        headers={"X-Request-Id": "trace/0002:x"},
        json={"messages": [{"role": "user", "content": "alpha beta gamma"}], "max_tokens": 4, "stream": True},
    ) as streamed:
        streamed.read()
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "trace/0002:x"
    chunks = _sse(streamed)
    assert {ch["id"] for ch in chunks} == {"trace/0002:x"}
    assert env["redis"].exists(_journal(env, "trace/0002:x"))
    assert re.fullmatch(r"trace/0002:x-[0-9a-f]{8}", _engine_request(env, "trace/0002:x-").request_id)
    # Such a stream resumes by that id (it holds a "/"), on the other gateway, event for event.
    replay = env["b"].get("/v1/streams/trace/0002:x")
    assert replay.status_code == 200, replay.text
    assert _sse(replay) == chunks and replay.headers["x-request-id"] == "trace/0002:x"
    # Without the header: a fresh id, which is the engine id too, echoed as well.
    response = _completion(c, "no header here")
    rid = response.json()["id"]
    assert rid.startswith("cmpl-") and response.headers["x-request-id"] == rid
    assert _engine_request(env, rid).request_id == rid
    # Errors carry the client's id back too.
    err = _completion(c, "x", "trace-0003", max_tokens=-1)
    assert err.status_code == 400 and err.headers["x-request-id"] == "trace-0003"


@pytest.mark.parametrize(
    "value, words",
    [
        ("x" * (MAX_REQUEST_ID_CHARS + 1), [f"at most {MAX_REQUEST_ID_CHARS}", str(MAX_REQUEST_ID_CHARS + 1)]),
        ("two words", ["visible ASCII"]),
        ("tab\there", ["visible ASCII"]),
        ("caf\u00e9".encode("latin-1"), ["visible ASCII", "\\xe9"]),
    ],
)
def test_bad_x_request_id_is_a_clear_400(env: dict[str, Any], value: str | bytes, words: list[str]) -> None:
    seen = len(env["engine"].seen)
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        err = _error(env["a"].post(path, json=body, headers={"X-Request-Id": value}), 400, "X-Request-Id", *words)
        assert err["param"] == "X-Request-Id" and err["code"] == "invalid_request_id"
    assert len(env["engine"].seen) == seen  # nothing reached the engine
    assert _completion(env["a"], "fine", "x" * MAX_REQUEST_ID_CHARS).status_code == 200


def _concurrently(*calls: Any) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_same_id_twice_in_flight_does_not_mix_on_one_gateway_or_two(env: dict[str, Any]) -> None:
    """Requests sharing a client's id (non-streaming) are all served, each with its own output:
    their engine ids differ by their suffix."""
    prompts = ["red green blue yellow", "one two three four", "cat dog bird fish", "sun moon star sky"]
    calls = [
        lambda c=c, p=p: _completion(c, p, "dup-1", max_tokens=HOLD_MAX_TOKENS)
        for c, p in zip((env["a"], env["a"], env["b"], env["b"]), prompts)
    ]
    env["engine"].release.clear()
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        deadline = time.time() + 10  # all four in flight at once, then let them finish
        while sum(r.request_id.startswith("dup-1-") for r in env["engine"].seen) < 4 and time.time() < deadline:
            time.sleep(0.02)
        env["engine"].release.set()
        responses = [f.result() for f in futures]
    for prompt, response in zip(prompts, responses):
        assert response.status_code == 200, response.text
        assert response.json()["id"] == "dup-1"
        assert response.json()["choices"][0]["text"] == _expected_text(env, prompt, HOLD_MAX_TOKENS)
    engine_ids = [r.request_id for r in env["engine"].seen if r.request_id.startswith("dup-1-")]
    assert len(engine_ids) == len(set(engine_ids)) == 4
    assert sorted(r.gateway_id for r in env["engine"].seen if r.request_id in engine_ids) == ["gwA", "gwA", "gwB", "gwB"]


def test_a_streams_id_is_taken_while_it_is_in_flight_or_resumable(env: dict[str, Any]) -> None:
    """A stream is resumed by its id, so one id names one stream: a second stream with a client's
    id that is in flight, on the same gateway or another, or finished but still resumable, gets a
    409 and never reaches the engine; a non-streaming request with it is served, unmixed."""
    a, b, engine = env["a"], env["b"], env["engine"]
    engine.release.clear()
    body = {"prompt": "first stream words here", "max_tokens": HOLD_MAX_TOKENS, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: a.post("/v1/completions", json=body, headers={"X-Request-Id": "stream-1"}))
        deadline = time.time() + 10
        while not any(r.request_id.startswith("stream-1-") for r in engine.seen) and time.time() < deadline:
            time.sleep(0.02)
        for client in (a, b):
            err = _error(
                client.post("/v1/completions", json={**body, "prompt": "second"}, headers={"X-Request-Id": "stream-1"}),
                409,
                "stream-1",
                "/v1/streams/stream-1",
            )
            assert err["code"] == "duplicate_request_id" and err["param"] == "X-Request-Id"
        other = _completion(b, "not a stream at all", "stream-1")
        assert other.status_code == 200 and other.json()["choices"][0]["text"] == _expected_text(env, "not a stream at all")
        engine.release.set()
        response = first.result()
    assert response.status_code == 200
    text = "".join(ch["choices"][0]["text"] for ch in _sse(response))
    assert text == _expected_text(env, "first stream words here", HOLD_MAX_TOKENS)
    assert [r.request_id.startswith("stream-1-") for r in engine.seen].count(True) == 2  # the stream, the other
    # Finished, but resumable for the resume window: still taken.
    _error(_completion(b, "again", "stream-1", stream=True), 409, "stream-1")
    # A refused claim leaves the journal as it was: the stream replays whole.
    assert "".join(ch["choices"][0]["text"] for ch in _sse(b.get("/v1/streams/stream-1"))) == text


def test_a_claimed_id_is_freed_when_the_stream_cannot_start(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal was claimed, then no engine took the request (it vanished meanwhile): the 503
    leaves the id free, for the client's retry."""

    async def no_engine(*_: Any) -> bool:
        return False

    monkeypatch.setattr(env["apps"][0].state.client, "_route", no_engine)
    _error(_completion(env["a"], "hi", "orphan-1", stream=True), 503, "engine unavailable")
    assert not env["redis"].exists(_journal(env, "orphan-1"))
    monkeypatch.undo()
    assert _completion(env["a"], "hi there", "orphan-1", stream=True).status_code == 200


# -- the request log ---------------------------------------------------------------------------
@pytest.fixture()
def request_log() -> Iterator[dict[str, io.StringIO]]:
    """The gateways' request log lines, as text and as JSON (each handler redacting the API key)."""
    logger = logging.getLogger("conveyor.gateway.requests")
    streams = {"text": io.StringIO(), "json": io.StringIO()}
    handlers = []
    for name, stream in streams.items():
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter(name))
        handler.addFilter(RedactingFilter([API_KEY]))
        logger.addHandler(handler)
        handlers.append(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield streams
    finally:
        logger.setLevel(level)
        for handler in handlers:
            logger.removeHandler(handler)


def _json_records(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one JSON object


def test_one_request_log_line_per_finished_request(env: dict[str, Any], request_log: dict[str, io.StringIO]) -> None:
    response = _completion(env["a"], "alpha beta gamma delta epsilon", "log-1", max_tokens=4)
    usage = response.json()["usage"]
    with env["b"].stream(
        "POST",
        "/v1/completions",
        headers={"X-Request-Id": "log-2"},
        json={"prompt": "zeta eta theta iota", "max_tokens": 3, "stream": True, "stop": ["never"]},
    ) as streamed:
        streamed.read()
    records = {rec["request_id"]: rec for rec in _json_records(request_log["json"])}
    rec = records["log-1"]
    engine_id = _engine_request(env, "log-1-").request_id
    assert rec["message"] == "request finished" and rec["logger"] == "conveyor.gateway.requests"
    assert rec["level"] == "INFO" and rec["time"].endswith("+00:00")
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert rec["completion_tokens"] == 4 and rec["finish_reason"] == "length"
    assert (rec["model"], rec["kind"], rec["stream"], rec["resumed"]) == ("tiny", "completion", False, False)
    assert (rec["engine"], rec["engine_request_id"], rec["gateway"], rec["migrations"]) == (ENGINE, engine_id, "gwA", 0)
    assert 0 < rec["ttft_s"] <= rec["total_s"] < 30
    rec = records["log-2"]
    assert (rec["completion_tokens"], rec["stream"], rec["gateway"]) == (3, True, "gwB")
    # The text line says the same, as key=value pairs.
    line = next(line for line in request_log["text"].getvalue().splitlines() if "request_id=log-1 " in line)
    assert "INFO conveyor.gateway.requests: request finished: request_id=log-1 model=tiny" in line
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens=4 " in line
    assert f"finish_reason=length engine={ENGINE} engine_request_id={engine_id} migrations=0" in line


def test_request_log_redacts_secrets_in_both_formats(env: dict[str, Any], request_log: dict[str, io.StringIO]) -> None:
    """A secret that reaches a structured field (here: a client sends the API key as its request
    id) is redacted in the JSON fields as in the text."""
    assert _completion(env["a"], "one two three", API_KEY).status_code == 200
    for stream in request_log.values():
        assert API_KEY not in stream.getvalue() and "***" in stream.getvalue()
    rec = _json_records(request_log["json"])[-1]
    assert rec["request_id"] == "***" and re.fullmatch(r"\*\*\*-[0-9a-f]{8}", rec["engine_request_id"])


def test_redacting_filter_leaves_the_callers_fields_alone() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    fields = {"a": "key sk-1", "n": 1}
    setattr(record, STRUCTURED, ("event", fields))
    RedactingFilter(["sk-1"]).filter(record)
    assert getattr(record, STRUCTURED) == ("event", {"a": "key ***", "n": 1}) and fields["a"] == "key sk-1"


# -- truncate_prompt_tokens (vLLM's) -------------------------------------------------------------
def test_truncate_prompt_tokens_sends_the_prompts_last_tokens(env: dict[str, Any]) -> None:
    """Through the real `openai` client, one prompt and a list of two (the fan-out path): the engine
    gets the last tokens (a BOS kept), usage counts them, and an echo shows what the model read."""
    import openai

    tok = env["tokenizer"]
    words = "one two three four five six seven eight nine ten " * 10
    ids = tok(words, add_special_tokens=False)["input_ids"]
    base = str(env["a"].base_url)
    with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=30) as client:
        out = client.completions.create(
            model=str(env["model"]),
            prompt=words,
            max_tokens=3,
            echo=True,
            extra_body={"truncate_prompt_tokens": 6},
            extra_headers={"X-Request-Id": "trunc-one"},
        )
        kept = [tok.bos_token_id] + ids[-5:]
        assert _engine_request(env, "trunc-one").prompt_token_ids == kept
        assert out.usage is not None and out.usage.prompt_tokens == 6
        assert out.choices[0].text.startswith(tok.decode(kept))
        both = client.completions.create(
            model=str(env["model"]),
            prompt=[words, ids],
            max_tokens=2,
            extra_body={"truncate_prompt_tokens": 4},
            extra_headers={"X-Request-Id": "trunc-two"},
        )
        assert both.usage is not None and both.usage.prompt_tokens == 8
        seen = sorted(req.prompt_token_ids for req in env["engine"].seen if req.request_id.startswith("trunc-two"))
        assert seen == sorted([[tok.bos_token_id] + ids[-3:], ids[-4:]])
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.completions.create(model=str(env["model"]), prompt=words, extra_body={"truncate_prompt_tokens": 0})


def test_bad_words_reach_the_engine_as_token_sequences(env: dict[str, Any]) -> None:
    """``bad_words`` are tokenized at the gateway, each word as it starts a text and as it follows a
    space (vLLM's two spellings); bad lists are 400s naming the field."""
    import openai

    from gateway.openai.tokenization import bad_words_token_ids

    tok = env["tokenizer"]
    base = str(env["a"].base_url)
    words = ["hello", " world", "tokenization"]
    with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=30) as client:
        client.completions.create(
            model=str(env["model"]),
            prompt="one two",
            max_tokens=2,
            extra_body={"bad_words": words},
            extra_headers={"X-Request-Id": "bad-words"},
        )
        sent = _engine_request(env, "bad-words").sampling["bad_words_token_ids"]
        assert sent == bad_words_token_ids(tok, threading.Lock(), words)
        bare = tok("hello", add_special_tokens=False)["input_ids"]
        spaced = tok(" hello", add_special_tokens=False)["input_ids"]
        assert sent[0] == bare and (sent[1] == spaced) == (len(spaced) == len(bare) and spaced[0] != bare[0])
        for value, words_in_error in (
            (["  "], "not only spaces"),
            (["x"] * 129, "at most 128 strings"),
            (["a b c d e f g h i j " * 12] * 64, "at most 128 token sequences of 1024 tokens"),
        ):
            with pytest.raises(openai.BadRequestError, match=words_in_error) as err:
                client.completions.create(model=str(env["model"]), prompt="p", extra_body={"bad_words": value})
            assert err.value.body is not None and err.value.body.get("param") == "bad_words"  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError, match="cannot be combined"):
            client.completions.create(
                model=str(env["model"]),
                prompt="p",
                extra_body={"bad_words": ["x"], "response_format": {"type": "json_object"}},
            )


def test_a_resumed_stream_keeps_its_bad_words(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream resumed on another gateway re-parses its body: its bad words are tokenized again,
    so the engine it may move to later still bans them."""
    from gateway.openai.tokenization import bad_words_token_ids

    words = ["hello", "tokenization"]
    body = {"prompt": "one two three", "max_tokens": 3, "stream": True, "bad_words": words}
    assert env["a"].post("/v1/completions", json=body, headers={"X-Request-Id": "resume-bad"}).status_code == 200
    client = env["apps"][1].state.client
    adopt, seen = client.adopt, []

    async def recording(*args: Any) -> Any:
        seen.append(args[2])  # the sampling map
        return await adopt(*args)

    monkeypatch.setattr(client, "adopt", recording)
    resumed = env["b"].get("/v1/streams/resume-bad")
    assert resumed.status_code == 200 and _sse(resumed)
    want = bad_words_token_ids(env["tokenizer"], threading.Lock(), words)
    assert seen and seen[0]["bad_words_token_ids"] == want == _engine_request(env, "resume-bad").sampling["bad_words_token_ids"]


def test_a_fan_out_is_bounded_by_the_sampling_bytes_it_carries(env: dict[str, Any]) -> None:
    """Each prompt and sample is a request of its own to the engine, with its own copy of the
    sampling parameters: a long allowed_token_ids list times 64 sequences is a 400 (the engine
    would decode and check every copy between steps), that list on its own is served."""
    allowed = list(range(VOCAB_SIZE)) * (32768 // VOCAB_SIZE)
    body = {"prompt": ["one two"] * 32, "n": 2, "max_tokens": 2, "allowed_token_ids": allowed}
    err = _error(env["a"].post("/v1/completions", json=body), 400, "sampling parameters", "over 4194304")
    assert err["param"] == "n"
    assert not any(len(r.sampling.get("allowed_token_ids") or ()) == len(allowed) for r in env["engine"].seen)
    ok = env["a"].post("/v1/completions", json={**body, "prompt": "one two", "n": 1})
    assert ok.status_code == 200


def test_priority_needs_an_engine_with_the_priority_policy(env: dict[str, Any]) -> None:
    """vLLM's ``priority``: a 400 for an engine that serves first come, first served (vLLM's rule
    without its priority policy); to one with the policy it goes with the request."""
    err = _error(_completion(env["a"], "one two", priority=3), 400, "--scheduling-policy priority", "fcfs")
    assert err["param"] == "priority"
    _error(_completion(env["a"], "one two", priority=2**40), 400, "'priority' must be in")
    register_engine(env["redis"], env["names"], env["model"], scheduling_policy="priority")
    try:
        deadline = time.time() + 10
        while (response := _completion(env["a"], "one two", "prio-1", priority=-3)).status_code == 400:
            assert time.time() < deadline, response.text  # until the gateway re-reads the engine
            time.sleep(0.2)
        assert response.status_code == 200 and _engine_request(env, "prio-1").priority == -3
    finally:
        register_engine(env["redis"], env["names"], env["model"])


def test_cache_salt_reaches_the_engine_and_bad_ones_are_400s(env: dict[str, Any]) -> None:
    """vLLM's ``cache_salt`` goes with the request (the engine keeps its prefix-cache entries
    apart: tests/test_api_parallel.py); an empty or non-string salt is a 400 naming it."""
    assert _completion(env["a"], "one two", "salted-1", cache_salt="tenant-secret-0123").status_code == 200
    assert _engine_request(env, "salted-1").cache_salt == "tenant-secret-0123"
    assert _completion(env["a"], "one two", "unsalted-1").status_code == 200
    assert _engine_request(env, "unsalted-1").cache_salt == ""
    for bad_salt in ("", 7, "x" * 1025):
        err = _error(_completion(env["a"], "one two", cache_salt=bad_salt), 400, "cache_salt")
        assert err["param"] == "cache_salt"


def test_vllms_request_id_field_is_the_request_id_without_the_header(env: dict[str, Any]) -> None:
    """vLLM's body field ``request_id`` stands for ``X-Request-Id`` when the header is absent (the
    header wins, as in vLLM), with the same rules and the same journal claim for a stream."""
    c = env["a"]
    response = c.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 3, "request_id": "body-0001"})
    assert response.status_code == 200 and response.json()["id"] == "body-0001"
    assert response.headers["x-request-id"] == "body-0001"
    assert re.fullmatch(r"body-0001-[0-9a-f]{8}", _engine_request(env, "body-0001-").request_id)
    both = c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "request_id": "body-0002"},
        headers={"X-Request-Id": "header-0002"},
    )
    assert both.status_code == 200 and both.json()["id"] == "header-0002"
    streamed = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "stream": True, "request_id": "body-0003"})
    assert {ch["id"] for ch in _sse(streamed)} == {"body-0003"} and env["redis"].exists(_journal(env, "body-0003"))
    for bad_id in ("has space", 12):
        err = _error(c.post("/v1/completions", json={"prompt": "a", "request_id": bad_id}), 400, "request_id")
        assert err["param"] == "request_id" and err["code"] == "invalid_request_id"
        # Checked with the header too (which would win): a bad field is a 400 all the same.
        bad_too = c.post("/v1/completions", json={"prompt": "a", "request_id": bad_id}, headers={"X-Request-Id": "h-1"})
        assert _error(bad_too, 400, "request_id")["param"] == "request_id"
    # An error of the request itself echoes the body's id, as it does the header's.
    invalid = c.post("/v1/completions", json={"prompt": "a", "temperature": "hot", "request_id": "echo-me"})
    assert invalid.status_code == 400 and invalid.headers["x-request-id"] == "echo-me"


def test_the_models_generation_config_gives_the_sampling_defaults(env: dict[str, Any]) -> None:
    """vLLM's ``--generation-config auto``: what a request leaves out is the model's (Qwen3's
    temperature 0.6, top_p 0.95, top_k 20), what it sets is its own; a value the engine would
    refuse (min_p -1) is ignored; ``vllm`` keeps OpenAI's defaults."""
    messages = [{"role": "user", "content": "hi"}]
    for client, rid, body, want in (
        (env["c"], "defaults-1", {"messages": messages}, SAMPLING_DEFAULTS),
        (env["c"], "defaults-2", {"prompt": "hi", "temperature": 0.2}, {**SAMPLING_DEFAULTS, "temperature": 0.2}),
        (
            env["d"],
            "defaults-3",
            {"messages": messages},
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
        ),
        (
            env["a"],
            "defaults-4",
            {"messages": messages},
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
        ),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = client.post(path, json={**body, "max_tokens": 2}, headers={"X-Request-Id": rid})
        assert r.status_code == 200, r.text
        sampling = _engine_request(env, f"{rid}-").sampling
        assert {k: sampling[k] for k in want} == want and sampling.get("min_p", 0.0) == 0.0
    # A stream resumed elsewhere keeps them: they are journaled with the body.
    with env["c"].stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "defaults-5"},
    ) as r:
        r.read()
    header = decode(env["redis"].xrange(_journal(env, "defaults-5"), count=1)[0][1][b"m"])
    assert {k: json.loads(header.body)[k] for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS


def _journal(env: dict[str, Any], response_id: str) -> str:
    """The journal of a stream of this module's key: named by its tenant (no tenant secret: the namespace keys it)."""
    names = env["names"]
    return str(names.journal(Tenant(tenant_id(names.namespace.encode(), API_KEY)).scope(response_id)))
