"""The Responses API through the real stack (processes, Redis, HTTP) with the real `openai`
client's ``responses``: plain, streamed, tools, structured ``text.format``, reasoning items,
``previous_response_id``, retrieve, delete, background (and cancel), and OpenAI's errors.
A response runs over the chat path, so a chat completion of the same messages at temperature 0
is what it must say."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from common.protocol import RESPONSE_LEASE_MS
from infra.launcher import free_port, wait_healthy
from infra.stack import Stack

pytestmark = pytest.mark.stack

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA},
    {"type": "function", "name": "add", "parameters": ADD},
]
# The random model would not write a call of its own: a regex makes it write one in Hermes' format.
FORCED = r'Checking\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model(), Path(tmp_path_factory.mktemp("responses")), executor_args=("--num-blocks", "256"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def parsing_client(stack: Stack) -> openai.OpenAI:
    """A second gateway on the stack, with vLLM's flags for "auto" tool calls and reasoning."""
    stack.ports.append(free_port())
    i = len(stack.ports) - 1
    proc = stack.spawn_gateway(
        i, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"
    )
    wait_healthy(f"{stack.urls[i]}/health", 60, [proc])
    return openai.OpenAI(base_url=f"{stack.urls[i]}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat_text(client: openai.OpenAI, messages: Any, max_tokens: int) -> tuple[str, int]:
    out = client.chat.completions.create(model="", messages=messages, max_tokens=max_tokens, temperature=0)
    assert out.usage is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens


def test_a_plain_response_says_what_chat_says(client: openai.OpenAI) -> None:
    out = client.responses.create(model="", input="Hello there", instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.status == "incomplete"
    assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in out.output] == ["message"]
    message = out.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text, prompt_tokens = _chat_text(client, messages, 6)
    assert out.output_text == text and text
    assert out.usage is not None and out.usage.input_tokens == prompt_tokens and out.usage.output_tokens == 6
    assert out.usage.total_tokens == prompt_tokens + 6 and out.usage.input_tokens_details.cached_tokens == 0
    assert out.max_output_tokens == 6 and out.instructions == "Be brief." and out.store is True


def test_a_streamed_response_sends_openais_events_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="", input="Stream me", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model="", input="Stream me", max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(d.delta for d in deltas) == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 8 and final.id == events[0].response.id  # type: ignore[union-attr]
    # Stored as streamed.
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_function_tools_required_and_named_then_their_results(client: openai.OpenAI) -> None:
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    out = client.responses.create(
        model="", input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=200, extra_body={"seed": 5}
    )
    calls = [item for item in out.output if item.type == "function_call"]
    assert out.status == "completed" and calls
    for call in calls:
        assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    # A named tool (with bounded arguments, so the random model always finishes them).
    named_choice: Any = {"type": "function", "name": "get_weather"}
    ask: Any = dict(model="", input="Weather in Paris?", tools=TOOLS, tool_choice=named_choice, max_output_tokens=200)
    named = client.responses.create(**ask, extra_body={"seed": 6})
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    # Streamed: the call's item, its argument deltas, then its done events.
    events = list(client.responses.create(**ask, extra_body={"seed": 6}, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call" and added[0].item.name == "get_weather"  # type: ignore[union-attr]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == call.arguments  # type: ignore[union-attr]
    assert events[-1].type == "response.completed"
    # The result goes back as a function_call_output item of the next turn, after the stored call.
    reply = client.responses.create(
        model="",
        previous_response_id=named.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3"}],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=3,
    )
    assert reply.status == "incomplete" and reply.output[0].type == "message" and reply.previous_response_id == named.id
    # The same turn sent whole (the call as an input item) reads the same prompt.
    whole = client.responses.create(
        model="",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "3"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=3,
        store=False,
    )
    assert whole.usage is not None and reply.usage is not None and whole.usage.input_tokens == reply.usage.input_tokens
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_structured_text_format(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}
    out = client.responses.create(model="", input="A trip", text={"format": fmt}, max_output_tokens=200, extra_body={"seed": 3})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text is not None and out.text.format is not None and out.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="", input="Knock knock", instructions="Joke.", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model="", input="Who is there?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    # The earlier input and output are the history; the earlier instructions are not carried over.
    messages = [
        {"role": "user", "content": "Knock knock"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Who is there?"},
    ]
    text, prompt_tokens = _chat_text(client, messages, 4)
    assert second.output_text == text and second.usage is not None and second.usage.input_tokens == prompt_tokens
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="", input="x", previous_response_id="resp_nope", max_output_tokens=2)


def test_retrieve_and_delete(client: openai.OpenAI) -> None:
    out = client.responses.create(model="", input="Keep me", max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(out.id)
    assert info.value.status_code == 404 and info.value.body["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(out.id)


def test_bad_input_is_a_400_in_openais_format(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="", input=[{"type": "function_call", "name": "add"}])  # type: ignore[list-item]
    assert info.value.body["param"] == "input" and "call_id" in info.value.body["message"]  # type: ignore[index]
    r = httpx.post(f"{stack.urls[0]}/v1/responses", json={"input": "x", "tools": [{"type": "web_search"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = httpx.post(f"{stack.urls[0]}/v1/responses", json={"input": "x", "background": True, "store": False}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"


def _wait(client: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_background_responses_run_after_the_reply_and_can_be_cancelled(stack: Stack, client: openai.OpenAI) -> None:
    out = client.responses.create(model="", input="Later", background=True, max_output_tokens=5, temperature=0)
    assert out.status == "queued" and out.background is True and out.output == []
    done = _wait(client, out.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5
    foreground = client.responses.create(model="", input="Later", max_output_tokens=5, temperature=0, store=False)
    assert done.output_text == foreground.output_text
    # A long one, cancelled: it stays cancelled, and its generation stops.
    long = client.responses.create(
        model="", input="Go on", background=True, max_output_tokens=2000, extra_body={"ignore_eos": True}
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)
    assert client.responses.retrieve(long.id).status == "cancelled"
    now = time.time()
    stack.wait_stats(lambda s: s.updated_at > now and s.num_running == 0 and s.num_waiting == 0, 30)
    # A plain response cannot be cancelled.
    plain = client.responses.create(model="", input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(plain.id)


def test_a_background_response_whose_gateway_died_reads_failed(stack: Stack, client: openai.OpenAI) -> None:
    """No gateway holds its lease: as after the one running it died."""
    response = {"id": "resp_orphan", "object": "response", "status": "in_progress", "output": [], "background": True}
    key = stack.names.response("resp_orphan")
    stack.redis.hset(key, mapping={"status": "in_progress", "owner": "", "response": json.dumps(response), "history": "[]"})
    stack.redis.pexpire(key, 60_000)
    got = httpx.get(f"{stack.urls[0]}/v1/responses/resp_orphan", timeout=30).json()
    assert got["status"] == "failed" and "stopped" in got["error"]["message"]
    assert stack.redis.hget(key, "status") == b"failed"
    assert 0 < stack.redis.pttl(key) <= 3_600_000  # never kept forever
    # Another key's response is none of this client's business: a 404, as an unknown id.
    theirs = stack.names.response("resp_theirs")
    stack.redis.hset(theirs, mapping={"status": "completed", "owner": "another-key", "response": "{}", "history": "[]"})
    stack.redis.pexpire(theirs, 60_000)
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{stack.urls[0]}/v1/responses/resp_theirs", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert stack.redis.exists(theirs)


@pytest.mark.slow  # a gateway started, then its lease left to lapse
def test_a_background_response_reads_failed_soon_after_its_gateway_is_killed(stack: Stack, client: openai.OpenAI) -> None:
    stack.ports.append(free_port())
    i = len(stack.ports) - 1
    proc = stack.spawn_gateway(i)
    wait_healthy(f"{stack.urls[i]}/health", 60, [proc])
    doomed = openai.OpenAI(base_url=f"{stack.urls[i]}/v1", api_key="unused", max_retries=0, timeout=60)
    out = doomed.responses.create(
        model="", input="Long", background=True, max_output_tokens=2000, extra_body={"ignore_eos": True}
    )
    assert client.responses.retrieve(out.id).status in ("queued", "in_progress")  # read on another gateway
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    got = _wait(client, out.id, timeout_s=RESPONSE_LEASE_MS / 1000 + 15)
    assert got.status == "failed" and got.error is not None and "stopped" in got.error.message
    assert time.monotonic() - killed < RESPONSE_LEASE_MS / 1000 + 5


def test_reasoning_items_and_auto_tool_calls(parsing_client: openai.OpenAI) -> None:
    """deepseek_r1: the random model never writes ``</think>``, so all its output is reasoning."""
    out = parsing_client.responses.create(model="", input="Think", max_output_tokens=6, temperature=0)
    assert [item.type for item in out.output] == ["reasoning"]
    reasoning = out.output[0]
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text
    events = list(parsing_client.responses.create(model="", input="Think", max_output_tokens=6, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas == done.text == reasoning.content[0].text  # type: ignore[union-attr]
    # "auto" tool calls, read by the gateway's parser (the regex makes the model write one; a grammar
    # binds from the first token, so there is no thinking then).
    forced: Any = {"structured_outputs": {"regex": FORCED}}
    out = parsing_client.responses.create(model="", input="1+2?", tools=TOOLS, max_output_tokens=200, extra_body=forced)
    assert [item.type for item in out.output] == ["message", "function_call"] and out.output_text == "Checking.\n"
    call = out.output[1]
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    events = list(
        parsing_client.responses.create(
            model="", input="1+2?", tools=TOOLS, max_output_tokens=200, extra_body=forced, stream=True
        )
    )
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed" and final.output_text == out.output_text
    assert final.output[1].arguments == call.arguments  # type: ignore[union-attr]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert added == ["message", "function_call"]


def test_a_background_stream_replays_from_any_gateway_after_a_sequence_number(
    stack: Stack, client: openai.OpenAI, parsing_client: openai.OpenAI
) -> None:
    """``background`` with ``stream``: the typed events as they come, the same again from
    ``retrieve(stream=True, starting_after=N)`` on another gateway (those after N, then live ones),
    only for the response's owner."""
    events = list(
        client.responses.create(
            model="", input="Stream it later", background=True, stream=True, max_output_tokens=8, extra_body={"ignore_eos": True}
        )
    )
    assert events[0].type == "response.created" and events[0].response.background is True
    assert events[-1].type == "response.incomplete" and [e.sequence_number for e in events] == list(range(len(events)))
    response_id, final = events[0].response.id, events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and client.responses.retrieve(response_id).output_text == text
    dumped = [e.model_dump() for e in events]
    for after in (-1, 3, len(events) - 2):
        replayed = list(parsing_client.responses.retrieve(response_id, stream=True, starting_after=after))
        assert [e.model_dump() for e in replayed] == dumped[after + 1 :]
    # A long one read live on the other gateway from its fourth event on, while it runs.
    live = client.responses.create(
        model="", input="Go on", background=True, stream=True, max_output_tokens=60, extra_body={"ignore_eos": True}
    )
    first = [next(live) for _ in range(4)]
    follower = list(parsing_client.responses.retrieve(first[0].response.id, stream=True, starting_after=3))
    rest = [e.model_dump() for e in live]
    assert [e.model_dump() for e in follower] == rest and rest[-1]["type"] == "response.incomplete"
    assert rest[-1]["response"]["usage"]["output_tokens"] == 60
    # A background response without stream has no events to stream; another key's is none (a 404).
    quiet = client.responses.create(model="", input="x", background=True, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(client.responses.retrieve(quiet.id, stream=True))
    theirs = stack.names.response("resp_theirs_streamed")
    stack.redis.hset(theirs, mapping={"status": "completed", "owner": "another-key", "response": "{}", "history": "[]"})
    stack.redis.pexpire(theirs, 60_000)
    stack.redis.xadd(stack.names.response_events("resp_theirs_streamed"), {"e": json.dumps(dumped[0])})
    r = httpx.get(f"{stack.urls[0]}/v1/responses/resp_theirs_streamed?stream=true&starting_after=-1", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
