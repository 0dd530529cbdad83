"""The full stack as separate processes over real Redis and real HTTP, driven by the openai client.

One module-scoped stack (one engine, two gateways, tiny checkpoint) serves every test. Faults
(processes killed under load) are tested in `tests/test_chaos.py`.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from common.protocol import GenerateRequest, StepOutputs, decode, encode
from common.sampling_params import SamplingParams
from infra.launcher import free_port, wait_healthy
from infra.stack import Stack

pytestmark = pytest.mark.stack

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tiny_model(),
        Path(tmp_path_factory.mktemp("stack")),
        gateways=2,
        executor_args=("--num-blocks", str(NUM_BLOCKS)),
        gateway_args=("--max-body-bytes", "200000"),
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Any:
    from gateway.llm import LLM

    return LLM(str(tiny_model()), num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def test_completions_match_offline_llm(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    model = client.models.list().data[0].id
    prompts = ["def hello(", "import os\nimport sys\n", "class Foo:"]
    expected = llm.generate(prompts, _greedy(24))
    for prompt, exp in zip(prompts, expected):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == exp.text
        assert r.usage.completion_tokens == len(exp.token_ids) and r.usage.prompt_tokens == len(exp.prompt_token_ids)
        chunks = list(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.text
        assert chunks[-1].usage.completion_tokens == len(exp.token_ids)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == exp.finish_reason
    # A prompt given as token ids.
    r = client.completions.create(model=model, prompt=expected[0].prompt_token_ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected[0].text


def test_chat_matches_offline_llm(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi in Python."}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    exp = llm.generate([ids], _greedy(20))[0]
    r = client.chat.completions.create(model=stack.stats().model_name, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == exp.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(messages=messages, model="", max_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == exp.text


def test_64_concurrent_streams(stack: Stack) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        n = 4 + i % 13
        stream = await client.completions.create(
            model="",
            prompt=f"x = {i} +",
            max_tokens=n,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return n, usage.completion_tokens if usage else -1, reason

    async def run() -> list[tuple[int, int, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{stack.urls[0]}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(run())
    assert all(got == want and reason == "length" for want, got, reason in results), results
    assert stack.wait_stats(lambda s: s.num_free_blocks == NUM_BLOCKS, 2).num_free_blocks == NUM_BLOCKS


def test_one_step_ahead_services_match_step_at_a_time_offline(stack: Stack, tiny_model: Any) -> None:
    """The services schedule one step ahead (the default); an offline engine that does not gives
    the same greedy and seeded tokens for concurrent streams."""
    _match_step_at_a_time(stack.urls[0], tiny_model)


def test_more_steps_in_flight_services_match_step_at_a_time_offline(tiny_model: Any, tmp_path: Path) -> None:
    """Three steps in flight (`--steps-in-flight 3`, for a Redis a network hop away): the same tokens."""
    three = Stack(
        tiny_model(), tmp_path, executor_args=("--num-blocks", str(NUM_BLOCKS)), scheduler_args=("--steps-in-flight", "3")
    ).start()
    try:
        _match_step_at_a_time(three.urls[0], tiny_model)
    finally:
        three.stop()


def _match_step_at_a_time(url: str, tiny_model: Any) -> None:
    from gateway.llm import LLM

    prompts = [[5 + i, 17, 3 * i + 1, 40] * (1 + i % 3) for i in range(12)]
    params = [SamplingParams(temperature=0.9 if i % 2 else 0.0, seed=i, max_tokens=6 + i % 5, ignore_eos=True) for i in range(12)]
    sync = LLM(str(tiny_model()), num_blocks=NUM_BLOCKS, async_scheduling=False)
    want = [(o.text, len(o.token_ids)) for o in sync.generate(prompts, params)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        p = params[i]
        r = await client.completions.create(
            model="",
            prompt=prompts[i],
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            seed=p.seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text, r.usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(12)))

    assert asyncio.run(run()) == want


def test_two_gateways_never_see_each_others_outputs(stack: Stack) -> None:
    gateway_ids = [httpx.get(f"{url}/health").json()["gateway_id"] for url in stack.urls]
    streams = [stack.names.outputs(g) for g in gateway_ids]
    seen: dict[str, set[str]] = {stream: set() for stream in streams}
    done = threading.Event()

    def watch() -> None:  # gateways trim what they read: watch the streams as entries arrive
        r = redis.Redis.from_url(stack.redis_url)
        cursors: dict[str, bytes | str] = {}
        for stream in streams:  # from the newest entry now, so nothing sent later is missed
            last = r.xrevrange(stream, count=1)
            cursors[stream] = last[0][0] if last else "0-0"
        ready.set()
        while not done.is_set():
            for name, entries in r.xread(cursors, block=100) or []:
                for entry_id, entry in entries:
                    cursors[name.decode()] = entry_id
                    seen[name.decode()].update(decode(entry[b"m"], (StepOutputs,)).request_ids)

    async def run(url: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:

            async def one(i: int) -> str:
                r = await c.completions.create(model="", prompt=f"# {i}", max_tokens=8, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 8
                return r.id

            return list(await asyncio.gather(*(one(i) for i in range(12))))

    async def both() -> list[list[str]]:
        return list(await asyncio.gather(*(run(url) for url in stack.urls)))

    ready = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait(5)
    ids = [set(x) for x in asyncio.run(both())]
    time.sleep(0.3)
    done.set()
    watcher.join(5)
    for k, stream in enumerate(streams):
        assert ids[k] <= seen[stream]  # every request of this gateway came back on its own stream...
        assert not (seen[stream] & ids[1 - k])  # ...and none of the other gateway's did


def _stream_lines(url: str, body: dict[str, Any], n: int) -> list[str]:
    """Open a stream, read ``n`` data lines, then hang up."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) >= n:
                    break
    return lines


def test_disconnect_aborts_and_frees_blocks(stack: Stack) -> None:
    body = {"prompt": "def f(", "max_tokens": 1800, "stream": True, "ignore_eos": True}
    steps0 = stack.stats().num_steps
    _stream_lines(stack.urls[1], body, 5)
    t0 = time.monotonic()
    stats = stack.wait_stats(lambda s: s.num_free_blocks == NUM_BLOCKS and s.num_running == 0, 3)
    assert stats.num_free_blocks == NUM_BLOCKS and time.monotonic() - t0 < 1.0, stats
    assert stats.num_steps - steps0 < 1000, "the request ran to completion instead of being aborted"
    # A non-streaming client that gives up is aborted as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.urls[0]}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    stats = stack.wait_stats(lambda s: s.num_free_blocks == NUM_BLOCKS and s.num_running == 0, 2)
    assert stats.num_free_blocks == NUM_BLOCKS, stats


def test_stop_string_cuts_output_and_frees_blocks(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    exp = llm.generate(["import os\n"], _greedy(40))[0].text
    stop = next(exp[i : i + 3] for i in range(4, len(exp) - 3) if "\ufffd" not in exp[i : i + 3] and exp[i : i + 3].strip())
    cut = exp.find(stop)
    # A long budget: the blocks come back only if the stop string aborts the request in the engine.
    steps0 = stack.stats().num_steps
    long = {"ignore_eos": True}
    r = client.completions.create(model="", prompt="import os\n", max_tokens=1800, temperature=0, stop=[stop], extra_body=long)
    assert r.choices[0].text == exp[:cut] and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="",
            prompt="import os\n",
            max_tokens=1800,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={**long, "include_stop_str_in_output": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == exp[:cut] + stop
    stats = stack.wait_stats(lambda s: s.num_running == 0, 2)
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_steps - steps0 < 1000, stats


def test_bad_input_gets_clear_errors_and_stack_keeps_serving(stack: Stack, client: openai.OpenAI) -> None:
    url = stack.urls[0]
    cases = [
        (b'{"prompt": ', "/v1/completions", 400, "not valid JSON"),
        ({"prompt": "hi", "max_tokens": "many"}, "/v1/completions", 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, "/v1/completions", 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**9}, "/v1/completions", 400, "2048"),
        ({"prompt": [1] * 2100}, "/v1/completions", 400, "2100 in the prompt"),
        ({"messages": []}, "/v1/chat/completions", 400, "messages"),
        ({"model": "nope", "prompt": "hi"}, "/v1/completions", 404, "nope"),
        ({"prompt": "x" * 300_000}, "/v1/completions", 413, "200000"),
    ]
    for body, path, status, word in cases:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{url}{path}", timeout=10, **kwargs)
        assert r.status_code == status and word in r.json()["error"]["message"], (body, r.text)
    # Garbage straight onto the requests stream, and a well-formed request with bad parameters.
    before = stack.stats().num_dead_letters
    requests = stack.names.requests("0")
    stack.redis.xadd(requests, {b"m": b"\x93garbage"})
    stack.redis.xadd(requests, {b"junk": b"1"})
    status = stack.stats()
    bad = GenerateRequest("bad-1", "nobody", "0", status.incarnation, [1, 2], [], {"temperature": -3.0}, 0.0)
    oov = GenerateRequest("bad-2", "nobody", "0", status.incarnation, [1, 2], [], {"stop_token_ids": [10**6]}, 0.0)
    for msg in (bad, oov):
        stack.redis.xadd(requests, {b"m": encode(msg)})
    assert stack.wait_stats(lambda s: s.num_dead_letters >= before + 2, 3).num_dead_letters == before + 2
    reasons = [e[b"reason"].decode() for _, e in stack.redis.xrange(stack.names.dead_letter)][-2:]
    assert "not a msgpack message" in reasons[0] and "has no 'm' field" in reasons[1], reasons
    # The well-formed request with bad parameters is answered on its gateway's stream, not dropped.
    deadline = time.monotonic() + 3
    while len(entries := stack.redis.xrange(stack.names.outputs("nobody"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    rejected = [decode(e[b"m"], expected=(StepOutputs,)) for _, e in entries]
    assert [r.request_ids for r in rejected] == [["bad-1"], ["bad-2"]]
    assert all(r.finish_reasons == ["rejected"] for r in rejected)
    assert "temperature" in (rejected[0].errors[0] or "") and "stop_token_ids" in (rejected[1].errors[0] or "")
    assert stack.redis.xlen(requests) <= 1, "taken requests are trimmed from the stream"
    r = client.completions.create(model="", prompt="still alive?", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


PENALTY_CASES = [  # SamplingParams keywords (temperature 0 unless given)
    dict(repetition_penalty=1.3),
    dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(frequency_penalty=-1.0, repetition_penalty=0.9, logit_bias={11: 3.0, 40: -100}),
    dict(temperature=0.9, seed=5, presence_penalty=0.8, repetition_penalty=1.2),
]


def _http_sampling(kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The openai client's arguments for ``kw``: native ones, and ``extra_body`` (vLLM's extras)."""
    native = {k: v for k, v in kw.items() if k in ("presence_penalty", "frequency_penalty", "seed")}
    if "logit_bias" in kw:
        native["logit_bias"] = {str(t): b for t, b in kw["logit_bias"].items()}  # JSON keys are strings
    extra = {"ignore_eos": True, **({"repetition_penalty": kw["repetition_penalty"]} if "repetition_penalty" in kw else {})}
    return native, extra


def test_penalties_and_logit_bias_match_offline_llm(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    """Completions (plain and streamed) and chat with penalties and biases give exactly the
    offline engine's output for the same parameters; the penalties do change the output."""
    prompts = ["def hello(", "import os\nimport sys\n"]
    messages = [{"role": "user", "content": "Say hi in Python."}]
    chat_text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = llm.tokenizer(chat_text, add_special_tokens=False)["input_ids"]
    n = 24
    changed = 0
    for kw in PENALTY_CASES:
        params = SamplingParams(**{"temperature": 0.0, **kw, "max_tokens": n, "ignore_eos": True})
        expected = llm.generate(prompts, params)
        plain = llm.generate(
            prompts,
            SamplingParams(**{"temperature": params.temperature, "seed": params.seed, "max_tokens": n, "ignore_eos": True}),
        )
        changed += sum(e.token_ids != q.token_ids for e, q in zip(expected, plain))
        native, extra = _http_sampling(kw)
        for prompt, exp in zip(prompts, expected):
            r = client.completions.create(
                model="", prompt=prompt, max_tokens=n, temperature=params.temperature, extra_body=extra, **native
            )
            assert r.choices[0].text == exp.text and r.usage.completion_tokens == n, kw
            chunks = list(
                client.completions.create(
                    model="", prompt=prompt, max_tokens=n, temperature=params.temperature, stream=True, extra_body=extra, **native
                )
            )
            assert "".join(c.choices[0].text for c in chunks) == exp.text, kw
        exp_chat = llm.generate([chat_ids], params)[0]
        r = client.chat.completions.create(
            model="", messages=messages, max_tokens=n, temperature=params.temperature, extra_body=extra, **native
        )
        assert r.choices[0].message.content == exp_chat.text, kw
    assert changed >= len(PENALTY_CASES), "penalties and biases should change most outputs"


def _openai_error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def test_bad_penalties_and_logit_bias_get_400(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    vocab = llm.executor.info.vocab_size
    cases: list[tuple[dict[str, Any], str, str]] = [
        (dict(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0]"),
        (dict(frequency_penalty=-3), "frequency_penalty", "[-2.0, 2.0]"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "[0.01, 100.0]"),
        (dict(extra_body={"repetition_penalty": -1.5}), "repetition_penalty", "[0.01, 100.0]"),
        (dict(logit_bias={str(vocab): 5}), "logit_bias", f"[0, {vocab}) (the vocabulary)"),
        (dict(logit_bias={"5": 150}), "logit_bias", "[-100.0, 100.0]"),
        (dict(logit_bias={"five": 1}), "logit_bias", "token ids"),
    ]
    messages = [{"role": "user", "content": "hi"}]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="", prompt="hi", max_tokens=4, **kwargs)
        err = _openai_error(info.value)
        assert info.value.status_code == 400 and err["param"] == param and words in err["message"], err
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="", messages=messages, max_tokens=4, stream=True, **kwargs)
        assert _openai_error(info.value)["param"] == param
    r = client.completions.create(model="", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3  # still serving


def _first_new_token(token_ids: list[int]) -> tuple[int, int]:
    """A token of a greedy output (and its index) that does not occur before it, well inside it."""
    return next((i, t) for i, t in enumerate(token_ids) if i >= 4 and t not in token_ids[:i])


def test_stop_reason(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    """``stop_reason`` (vLLM's): the stop string or the stop token id that ended the choice, else
    null (length); non-streaming and on the final streaming chunk (null before), completions and chat."""
    n = 30
    prompt = "import os\n"
    messages = [{"role": "user", "content": "Say hi in Python."}]
    chat_text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = llm.tokenizer(chat_text, add_special_tokens=False)["input_ids"]
    for kind in ("completion", "chat"):
        exp = llm.generate([prompt if kind == "completion" else chat_ids], _greedy(n))[0]
        k, token = _first_new_token(exp.token_ids)
        stop = next(
            exp.text[i : i + 3]
            for i in range(4, len(exp.text) - 3)
            if "\ufffd" not in exp.text[i : i + 3] and exp.text[i : i + 3].strip()
        )
        cases: list[tuple[dict[str, Any], str, int | str | None, int]] = [
            (dict(stop=[stop, "\x00never"]), "stop", stop, -1),
            (dict(extra_body={"stop_token_ids": [token], "ignore_eos": True}), "stop", token, k + 1),
            (dict(max_tokens=5, extra_body={"ignore_eos": True}), "length", None, 5),
        ]
        for kwargs, reason, stop_reason, num_tokens in cases:
            kwargs = {"max_tokens": n, "temperature": 0, **kwargs}
            if kind == "completion":
                r: Any = client.completions.create(model="", prompt=prompt, **kwargs)
                chunks = [c for c in client.completions.create(model="", prompt=prompt, stream=True, **kwargs) if c.choices]
            else:
                r = client.chat.completions.create(model="", messages=messages, **kwargs)
                chunks = [
                    c for c in client.chat.completions.create(model="", messages=messages, stream=True, **kwargs) if c.choices
                ]
            choice = r.choices[0]
            assert (choice.finish_reason, choice.model_extra["stop_reason"]) == (reason, stop_reason), (kind, kwargs)
            if num_tokens > 0:
                assert r.usage.completion_tokens == num_tokens  # a stop token ends the output on it
            assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop_reason]
            assert chunks[-1].choices[0].finish_reason == reason


def test_tokenize_and_detokenize_match_the_tokenizer_and_the_chat_count(stack: Stack, client: openai.OpenAI, llm: Any) -> None:
    tok, url = llm.tokenizer, stack.urls[0]
    text = "import os\nprint(os.getcwd())  # where am I?"
    got = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tok(text)["input_ids"] and got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == stack.stats().max_model_len
    assert httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": tok.decode(got["tokens"])}
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}]
    count = httpx.post(f"{stack.urls[1]}/tokenize", json={"model": "", "messages": messages}).json()["count"]
    assert client.chat.completions.create(model="", messages=messages, max_tokens=2).usage.prompt_tokens == count
    err = httpx.post(f"{url}/detokenize", json={"tokens": [len(tok) + 10**6]})
    assert err.status_code == 400 and err.json()["error"]["param"] == "tokens"


def _request_log(stack: Stack, request_id: str) -> list[dict[str, str]]:
    """The gateways' ``request finished`` log lines of ``request_id`` (text format), as dicts."""
    found = []
    for name in stack.procs:
        path = stack.workdir / f"{name}.log"
        if name.startswith("gateway") and path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if f"request finished: request_id={request_id} " in line:
                    found.append(dict(re.findall(r"(\w+)=(\S+)", line.split("request finished: ", 1)[1])))
    return found


def test_x_request_id_is_the_response_id_and_shared_ids_never_mix(stack: Stack, llm: Any) -> None:
    """Four requests with one client id, two on each gateway, at once: each gets its own output
    and its own engine id (the client's id plus a random suffix), which the request log lines show."""
    prompts = ["def add(a, b):", "class Stack:", "import json\n", "for i in range(10):"]
    expected = llm.generate(prompts, _greedy(12))

    async def run() -> list[Any]:
        clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) for url in stack.urls]
        try:
            return await asyncio.gather(
                *(
                    c.completions.with_raw_response.create(
                        model="", prompt=p, max_tokens=12, temperature=0, extra_headers={"X-Request-Id": "svc-dup-1"}
                    )
                    for c, p in zip((clients[0], clients[0], clients[1], clients[1]), prompts)
                )
            )
        finally:
            for c in clients:
                await c.close()

    raws = asyncio.run(run())
    for raw, exp in zip(raws, expected):
        r = raw.parse()
        assert raw.headers["x-request-id"] == r.id == "svc-dup-1"
        assert r.choices[0].text == exp.text
    lines = _request_log(stack, "svc-dup-1")
    assert len(lines) == 4, stack.logs()
    assert len({line["engine_request_id"] for line in lines}) == 4
    assert all(re.fullmatch(r"svc-dup-1-[0-9a-f]{8}", line["engine_request_id"]) for line in lines)
    assert sorted(int(line["completion_tokens"]) for line in lines) == sorted(len(e.token_ids) for e in expected)
    assert sorted(int(line["prompt_tokens"]) for line in lines) == sorted(len(e.prompt_token_ids) for e in expected)
    assert {(line["engine"], line["migrations"], line["finish_reason"]) for line in lines} == {("0", "0", "length")}


def test_a_streams_client_id_is_refused_while_taken_on_every_gateway(stack: Stack, llm: Any) -> None:
    expected = llm.generate(["def f("], _greedy(40))[0].text
    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) for url in stack.urls]
    kwargs: dict[str, Any] = dict(
        model="", max_tokens=40, temperature=0, stream=True, extra_headers={"X-Request-Id": "svc-stream-1"}
    )
    stream = clients[0].completions.create(prompt="def f(", **kwargs)
    chunks = [next(iter(stream))]  # in flight
    for c in clients:
        with pytest.raises(openai.ConflictError) as info:
            c.completions.create(prompt="x = 1", **kwargs)
        assert info.value.code == "duplicate_request_id"
    chunks.extend(stream)
    assert {c.id for c in chunks} == {"svc-stream-1"}
    assert "".join(c.choices[0].text for c in chunks) == expected
    with pytest.raises(openai.ConflictError):  # still resumable: still taken
        clients[1].completions.create(prompt="x = 1", **kwargs)


def test_a_gateway_logs_json_lines_with_secrets_redacted(stack: Stack, llm: Any) -> None:
    """``--log-format json``: the gateway's every log line is a JSON object; its request log line has
    the request's counts as fields, and a secret in a field (the API key sent as a request id) is
    redacted as it is in messages."""
    key = "sk-json-gateway-secret"
    port = free_port()
    proc = stack.spawn(
        "gateway-json", "gateway", "--host", "127.0.0.1", "--port", str(port), "--log-format", "json", "--api-key", key
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", 120, [proc])
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        r = c.completions.create(
            model="",
            prompt="def f(x):",
            max_tokens=7,
            temperature=0,
            extra_headers={"X-Request-Id": "svc-json-1"},
            extra_body={"ignore_eos": True},
        )
        c.completions.create(model="", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": key})
    finally:
        proc.terminate()
        proc.wait(10)
    text = (stack.workdir / "gateway-json.log").read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert key not in text
    rec = next(rec for rec in records if rec.get("request_id") == "svc-json-1")
    assert rec["message"] == "request finished" and rec["level"] == "INFO"
    assert (
        (rec["prompt_tokens"], rec["completion_tokens"])
        == (r.usage.prompt_tokens, r.usage.completion_tokens)
        == (len(llm.tokenizer("def f(x):")["input_ids"]), 7)
    )
    assert (rec["finish_reason"], rec["engine"], rec["migrations"]) == ("length", "0", 0)
    assert re.fullmatch(r"svc-json-1-[0-9a-f]{8}", rec["engine_request_id"]) and 0 < rec["ttft_s"] <= rec["total_s"]
    assert any(rec.get("request_id") == "***" for rec in records)


def test_executor_death_is_a_pause_not_an_error(stack: Stack, llm: Any) -> None:
    """kill -9 the executor mid-stream, restart it: the stream pauses, then completes exactly."""
    prompt, n = "def f(", 60
    expected = llm.generate([prompt], _greedy(n))[0].text
    body = {"prompt": prompt, "max_tokens": n, "stream": True, "temperature": 0}
    events: list[str] = []
    with httpx.stream("POST", f"{stack.urls[0]}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    stack.procs["executor0"].send_signal(signal.SIGKILL)
                    stack.procs["executor0"].wait()
                    stack.spawn_executor(0)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
