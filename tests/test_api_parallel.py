"""``n``, ``best_of``, lists of prompts and echo with prompt logprobs, and the resumption of their
streams on another gateway, through the real stack (Redis, two gateways, scheduler and executor
processes) with the real ``openai`` client and raw SSE readers."""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import EngineStatus
from infra.stack import Stack

pytestmark = pytest.mark.stack

BLOCK = 16  # the executor's default block size
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The priority policy: with every priority 0 (all but one test here) it serves as fcfs does.
    s = Stack(
        tiny_model(),
        Path(tmp_path_factory.mktemp("parallel")),
        gateways=2,
        executor_args=("--num-blocks", "256"),
        scheduler_args=("--scheduling-policy", "priority"),
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def settled(stack: Stack) -> EngineStatus:
    """The engine's status written after every earlier request ended (its counters are final)."""
    now = time.time()
    return stack.wait_stats(lambda s: s.updated_at > now and s.num_running == 0 and s.num_waiting == 0, 10)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_list_of_prompts_with_n_shares_each_prompt(stack: Stack, client: openai.OpenAI) -> None:
    prompts = [ids(2 * BLOCK + 8, 1), ids(3 * BLOCK + 1, 2)]
    before = settled(stack)
    out = client.completions.create(model="", prompt=prompts, n=2, max_tokens=5, temperature=0, extra_body=NO_EOS)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # Greedy: a prompt's two samples agree; each equals that prompt's n = 1 completion.
    for i, prompt in enumerate(prompts):
        single = client.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0, extra_body=NO_EOS)
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == single.choices[0].text
        assert all(c.finish_reason == "length" for c in out.choices[2 * i : 2 * i + 2])
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)  # each prompt once
    assert out.usage.completion_tokens == 4 * 5
    # The second sample of each prompt found all its prompt's full blocks cached (the first computed them).
    shared = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    after = settled(stack)
    # The n = 1 repeats hit the cache as well; without them the pairs alone hit `shared` tokens.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= shared


def test_n_shares_blocks_exactly(stack: Stack, client: openai.OpenAI) -> None:
    prompt = ids(4 * BLOCK + 5, 3)
    before = settled(stack)
    out = client.completions.create(model="", prompt=prompt, n=3, max_tokens=4, temperature=1.0, seed=11, extra_body=NO_EOS)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # seeds differ per child
    after = settled(stack)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 3 * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * ((len(prompt) - 1) // BLOCK * BLOCK)
    again = client.completions.create(model="", prompt=prompt, n=3, max_tokens=4, temperature=1.0, seed=11, extra_body=NO_EOS)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # reproducible


def test_streaming_n_interleaves_by_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "hello there"}],
        n=2,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        [choice] = chunk.choices
        assert choice.index not in finished, "nothing after a choice's finish_reason"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert texts[0] == texts[1] and texts[0]
    assert usage is not None and usage.completion_tokens == 12


def test_echo_with_logprobs_returns_prompt_logprobs(stack: Stack, client: openai.OpenAI) -> None:
    from transformers import AutoModelForCausalLM

    prompt = ids(21, 4)
    out = client.completions.create(
        model="", prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        assert lp.token_logprobs[pos] == pytest.approx(want[pos - 1, prompt[pos]].item(), abs=1e-3)
        assert len(lp.top_logprobs[pos]) >= 1
    assert lp.text_offset is not None and lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # With n = 2, every choice shows them.
    two = client.completions.create(
        model="", prompt=prompt, echo=True, logprobs=0, n=2, max_tokens=2, temperature=0, extra_body=NO_EOS
    )
    for choice in two.choices:
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:3] == lp.token_logprobs[1:3]


def _echo_request(**kwargs: Any) -> dict[str, Any]:
    return {"model": "", "prompt": ids(21, 5), "echo": True, "max_tokens": 3, "temperature": 0, "extra_body": NO_EOS, **kwargs}


def _prompt_part(lp: Any, n: int) -> dict[str, list[Any]]:
    """The first ``n`` entries of completions logprobs (an object or its JSON)."""
    get = lp.get if isinstance(lp, dict) else lambda key: getattr(lp, key)
    return {key: list(get(key))[:n] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _assert_same_prompt_logprobs(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)
    for top, top_want in zip(got["top_logprobs"][1:], want["top_logprobs"][1:]):
        assert top.keys() == top_want.keys() and list(top.values()) == pytest.approx(list(top_want.values()), abs=1e-5)


def test_streamed_echo_with_logprobs_carries_the_prompt_logprobs(client: openai.OpenAI) -> None:
    """vLLM's streamed echo: its chunk carries the prompt's logprobs, as the non-streaming echo does."""
    request = _echo_request(logprobs=2)
    n_prompt = len(request["prompt"])
    whole = client.completions.create(**request)
    want = _prompt_part(whole.choices[0].logprobs, n_prompt)
    assert want["token_logprobs"][0] is None and len(want["tokens"]) == n_prompt
    chunks = list(client.completions.create(**request, stream=True))
    echo = chunks[0].choices[0]
    plain = client.completions.create(**{**request, "echo": False})
    assert whole.choices[0].text.endswith(plain.choices[0].text)
    echo_text = whole.choices[0].text.removesuffix(plain.choices[0].text)
    assert echo.text == echo_text and echo.text and echo.finish_reason is None
    assert echo.logprobs is not None and len(echo.logprobs.tokens or []) == n_prompt
    _assert_same_prompt_logprobs(_prompt_part(echo.logprobs, n_prompt), want)
    # The rest are the generated tokens', as in the non-streaming response after the prompt's.
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    generated = [t for c in chunks[1:] if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert whole.choices[0].logprobs is not None and generated == (whole.choices[0].logprobs.tokens or [])[n_prompt:]
    # With n = 2, each choice's echo chunk (its first) carries them: child 0 computed them for both.
    firsts: dict[int, Any] = {}
    for chunk in client.completions.create(**request, n=2, stream=True):
        [choice] = chunk.choices
        firsts.setdefault(choice.index, choice)
    assert sorted(firsts) == [0, 1]
    for choice in firsts.values():
        assert choice.text == echo_text and choice.logprobs is not None
        _assert_same_prompt_logprobs(_prompt_part(choice.logprobs, n_prompt), want)
        assert len(choice.logprobs.tokens or []) == n_prompt


def test_streamed_echo_without_logprobs_is_unchanged(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(**_echo_request(), stream=True))
    whole = client.completions.create(**_echo_request())
    echo = chunks[0].choices[0]
    assert echo.text and whole.choices[0].text.startswith(echo.text) and echo.logprobs is None
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_resumed_streamed_echo_replays_the_prompt_logprobs(stack: Stack) -> None:
    """The prompt's logprobs are journaled with the first output: a resumed stream's echo chunk is
    the first gateway's, byte for byte."""
    request = _echo_request(logprobs=1, stream=True)
    del request["extra_body"]
    with httpx.Client(base_url=stack.urls[0], timeout=60) as http:
        first = http.post("/v1/completions", json={**request, **NO_EOS})
        assert first.status_code == 200, first.text
        rid = first.headers["x-request-id"]
        events = [e for e in first.text.split("\n\n") if e]
        echo = json.loads(events[0].split("data: ", 1)[1])["choices"][0]
        assert echo["logprobs"]["token_logprobs"][0] is None and len(echo["logprobs"]["tokens"]) == len(request["prompt"])
        assert http.get(f"/v1/streams/{rid}").text == first.text
        assert http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": ""}).text == first.text  # as n > 1 streams read it
        later = http.get(f"/v1/streams/{rid}", headers={"Last-Event-ID": "1"})
        assert [e for e in later.text.split("\n\n") if e] == events[1:]


def _generation_tokens(client: openai.OpenAI) -> float:
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))


def test_best_of_returns_n_choices(client: openai.OpenAI) -> None:
    before = _generation_tokens(client)
    out = client.completions.create(
        model="", prompt=ids(10, 5), n=2, best_of=4, max_tokens=4, temperature=1.0, seed=3, extra_body=NO_EOS
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)  # computed to rank, not asked for
    # Usage counts all 4 candidates' tokens (as OpenAI bills best_of), as the metrics do.
    assert out.usage is not None and out.usage.completion_tokens == 16
    assert _generation_tokens(client) - before == 16


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
    ],
)
def test_bad_parallel_requests_are_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="hi", max_tokens=2, **kwargs)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param


def sse_events(lines: Iterable[str], limit: int | None = None) -> list[tuple[str, str]]:
    """(id, data) of a stream's events; the first ``limit`` of them (a client that then hangs up)."""
    events: list[tuple[str, str]] = []
    event_id = ""
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            if limit is not None and len(events) >= limit:
                break
    return events


def per_choice(events: list[tuple[str, str]]) -> tuple[dict[int, str], dict[int, str], list[int], int]:
    """Each choice's text and finish reason, the usage chunks' completion tokens, and the [DONE]s."""
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage: list[int] = []
    for _, data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage.append(chunk["usage"]["completion_tokens"])
        for choice in chunk["choices"]:
            assert choice["index"] not in finished, "nothing after a choice's finish_reason"
            text = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + text
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = choice["finish_reason"]
    return texts, finished, usage, sum(data == "[DONE]" for _, data in events)


@pytest.mark.parametrize(
    "shape",
    [
        {"prompt": ids(20, 7), "n": 2, "temperature": 0.9, "seed": 11},
        {"prompt": [ids(20, 8), ids(9, 9)], "temperature": 0},
        {"messages": [{"role": "user", "content": "two answers"}], "n": 2, "temperature": 0.8, "seed": 3},
    ],
    ids=["n=2 seeded", "2 prompts greedy", "chat n=2 seeded"],
)
def test_multi_choice_stream_resumes_on_another_gateway(stack: Stack, shape: dict[str, Any]) -> None:
    """Read part of a stream with several choices from gateway A, hang up, resume on gateway B with
    the last event id: together, exactly the uninterrupted stream (per choice), usage and [DONE] once."""
    max_tokens, num_choices = 40, 2
    body = {"model": "", "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, **shape, **NO_EOS}
    a, b = stack.urls
    path = "/v1/chat/completions" if "messages" in shape else "/v1/completions"
    rid = f"multi-{uuid.uuid4().hex}"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", a + path, json=body) as r:
            whole = sse_events(r.iter_lines())
        with http.stream("POST", a + path, json=body, headers={"X-Request-Id": rid}) as r:
            assert r.headers["x-request-id"] == rid
            part = sse_events(r.iter_lines(), limit=5)
        assert re.fullmatch(r"c0\.\d+-c1\.\d+", part[-1][0]), part[-1][0]
        # A hung up: it aborted every choice. B replays each from the journal, then continues them.
        with http.stream("GET", f"{b}/v1/streams/{rid}", headers={"Last-Event-ID": part[-1][0]}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == rid
            rest = sse_events(r.iter_lines())
        # The id names one stream, on either gateway; a resume from the end is [DONE] alone.
        for url in (a, b):
            assert http.post(url + path, json=body, headers={"X-Request-Id": rid}).status_code == 409
        again = http.get(f"{a}/v1/streams/{rid}", headers={"Last-Event-ID": rest[-2][0]})
        assert [e for e in again.text.split("\n\n") if e] == [f"id: {rest[-1][0]}\ndata: [DONE]"]
        replayed = sse_events(http.get(f"{b}/v1/streams/{rid}").text.splitlines())
        bad = http.get(f"{b}/v1/streams/{rid}", headers={"Last-Event-ID": "7"})
        assert bad.status_code == 400 and "c0." in bad.json()["error"]["message"]
    texts, finished, usage, done = per_choice(whole)
    assert sorted(texts) == list(range(num_choices)) and finished == dict.fromkeys(range(num_choices), "length")
    assert usage == [num_choices * max_tokens] and done == 1
    assert len({e for e, _ in part + rest}) == len(part + rest)  # no event twice
    assert per_choice(part + rest) == (texts, finished, usage, 1)
    assert per_choice(replayed) == (texts, finished, usage, 1)


def test_return_tokens_as_token_ids_names_the_tokens_in_logprobs(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>`` (completions,
    echoed prompt included, and chat); the values and the text offsets are those without it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    prompt = ids(9, 6)
    args: dict[str, Any] = dict(model="", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
    plain = client.completions.create(**args, extra_body=NO_EOS).choices[0]
    named = client.completions.create(**args, extra_body={**NO_EOS, "return_tokens_as_token_ids": True}).choices[0]
    assert plain.logprobs is not None and named.logprobs is not None and named.logprobs.tokens is not None
    token_ids = [int(t.removeprefix("token_id:")) for t in named.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in named.logprobs.tokens) and token_ids[:9] == prompt
    assert [tok.decode([t]) for t in token_ids] == plain.logprobs.tokens
    assert named.text == plain.text and named.logprobs.text_offset == plain.logprobs.text_offset
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    for top, top_plain in zip(named.logprobs.top_logprobs or [], plain.logprobs.top_logprobs or []):
        assert (top is None) == (top_plain is None)
        if top is not None and top_plain is not None:
            # Two tokens whose texts are the same (such as two halves of UTF-8 characters, both
            # "\ufffd") are one key by text, two by id.
            assert {tok.decode([int(k.removeprefix("token_id:"))]) for k in top} == set(top_plain)
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=3,
        temperature=0,
        extra_body={**NO_EOS, "return_tokens_as_token_ids": True},
    ).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content is not None and len(chat.logprobs.content) == 3
    for entry in chat.logprobs.content:
        assert entry.token.startswith("token_id:") and bytes(entry.bytes or []) == entry.token.encode()
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)
    assert tok.decode([int(e.token.removeprefix("token_id:")) for e in chat.logprobs.content]) == chat.message.content


def test_allowed_token_ids_over_http(client: openai.OpenAI) -> None:
    """vLLM's ``allowed_token_ids`` through the services: every sampled token is one of them (the
    logprobs name the tokens); a bad list is a 400 naming the field."""
    allowed = [7, 11, 13, 42]
    out = client.completions.create(
        model="",
        prompt=ids(10, 7),
        max_tokens=12,
        logprobs=0,
        extra_body={**NO_EOS, "allowed_token_ids": allowed, "return_tokens_as_token_ids": True},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 12
    assert {int(t.removeprefix("token_id:")) for t in lp.tokens} <= set(allowed)
    for body, words in (
        ({"allowed_token_ids": []}, "array of 1 to"),
        ({"allowed_token_ids": [1, 10**6]}, "the vocabulary"),
        ({"allowed_token_ids": [1], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ):
        with pytest.raises(openai.BadRequestError, match=words) as err:
            client.completions.create(model="", prompt="hi", max_tokens=2, extra_body=body)
        assert err.value.body is not None and err.value.body.get("param") == "allowed_token_ids"  # type: ignore[union-attr]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk's usage
    counts the choice's tokens so far, a completion's and a chat's; the last chunk has the total."""
    prompt = ids(7, 8)
    stream = client.completions.create(
        model="",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert all(c.usage is not None and c.usage.prompt_tokens == 7 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].choices == []
    assert len([c for c in chunks if c.choices]) >= 2  # (at least two chunks, so "so far" was seen growing)
    chat = list(
        client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body=NO_EOS,
        )
    )
    assert all(c.usage is not None for c in chat)
    assert chat[0].usage is not None and chat[0].usage.completion_tokens == 0  # the role chunk
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 4
    # Without include_usage it asks for nothing (as vLLM's): no usage at all.
    plain = client.completions.create(
        model="",
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body=NO_EOS,
    )
    assert all(c.usage is None for c in plain)


def test_priorities_reach_an_engine_with_the_priority_policy(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``priority`` through the services (the scheduler's order is tests/test_priority_scheduling.py):
    requests of several priorities, at once and fanned out, come back as without them."""
    assert settled(stack).scheduling_policy == "priority"
    prompt = ids(9, 9)
    args: dict[str, Any] = dict(model="", prompt=prompt, max_tokens=4, temperature=0)
    plain = client.completions.create(**args, extra_body=NO_EOS).choices[0].text
    for priority in (-5, 0, 7):
        out = client.completions.create(**args, n=2, extra_body={**NO_EOS, "priority": priority})
        assert [c.text for c in out.choices] == [plain, plain]


def test_cache_salt_keeps_prefix_cache_entries_apart(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``cache_salt``: the same prompt hits the prefix cache under the same salt only, so
    one tenant cannot learn another's prompts from how fast they come back."""
    prompt = ids(3 * BLOCK + 5, 11)

    def hits(salt: str | None) -> int:
        before = settled(stack).prefix_cache_hits
        extra = {**NO_EOS, **({"cache_salt": salt} if salt is not None else {})}
        client.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return settled(stack).prefix_cache_hits - before

    assert hits("tenant-a-secret") == 0  # first seen
    assert hits("tenant-a-secret") == 3 * BLOCK  # the same salt: its full blocks hit
    assert hits("tenant-b-secret") == 0  # another salt: nothing
    assert hits(None) == 0  # no salt: nothing of the salted ones
    assert hits(None) == 3 * BLOCK


def test_return_token_ids_gives_the_prompts_and_the_outputs_tokens(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's ``return_token_ids``: a completion's choices carry ``prompt_token_ids`` and
    ``token_ids`` (streamed: the prompt's on the first chunk, each chunk's own tokens); a chat's
    response carries the prompt's (streamed: on the role chunk), its choices their tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    prompt = ids(10, 12)
    wanted = {**NO_EOS, "return_token_ids": True}
    args: dict[str, Any] = dict(model="", prompt=prompt, max_tokens=5, temperature=0)
    out = client.completions.create(**args, n=2, extra_body=wanted)
    for choice in out.choices:
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == 5
        assert tok.decode(extra["token_ids"]) == choice.text
    chunks = list(client.completions.create(**args, stream=True, extra_body=wanted))
    extras = [c.choices[0].model_extra or {} for c in chunks if c.choices]
    assert extras[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in e for e in extras[1:])
    assert [t for e in extras for t in e["token_ids"]] == (out.choices[0].model_extra or {})["token_ids"]
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="", messages=messages, max_tokens=4, temperature=0, extra_body=wanted)  # type: ignore[arg-type]
    chat_prompt = (chat.model_extra or {})["prompt_token_ids"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat_prompt == tok(text, add_special_tokens=False)["input_ids"]
    chat_ids = (chat.choices[0].model_extra or {})["token_ids"]
    assert tok.decode(chat_ids) == chat.choices[0].message.content
    stream = list(
        client.chat.completions.create(model="", messages=messages, max_tokens=4, temperature=0, stream=True, extra_body=wanted)  # type: ignore[arg-type]
    )
    assert (stream[0].model_extra or {})["prompt_token_ids"] == chat_prompt
    assert [t for c in stream[1:] for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == chat_ids
