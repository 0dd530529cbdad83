"""Structured outputs and tool calls through the real stack (processes, Redis, HTTP) with the real
`openai` client: the tiny random checkpoint's output is arbitrary, but must obey the constraint."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from infra.launcher import free_port, wait_healthy
from infra.stack import Stack

pytestmark = pytest.mark.stack

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model(), Path(tmp_path_factory.mktemp("structured")), executor_args=("--num-blocks", "256"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def test_json_schema_on_chat_and_completions(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    chat = client.chat.completions.create(model="", messages=MESSAGES, response_format=fmt, max_tokens=100, seed=1)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)
    done = client.completions.create(model="", prompt="A trip:", max_tokens=100, seed=2, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    obj = client.completions.create(model="", prompt="{", max_tokens=100, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)


def test_vllm_structured_outputs_regex_and_choice(client: openai.OpenAI) -> None:
    regex = client.completions.create(
        model="", prompt="id:", max_tokens=30, seed=3, extra_body={"structured_outputs": {"regex": r"[A-Z]{2}[0-9]{3}"}}
    )
    assert re.fullmatch(r"[A-Z]{2}[0-9]{3}", regex.choices[0].text)
    choices = ["positive", "negative", "neutral"]
    chat = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=30, seed=4, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    # Streamed, the pieces join to a valid choice too.
    stream = client.completions.create(
        model="", prompt="x", max_tokens=30, stream=True, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert "".join(c.choices[0].text for c in stream) in choices


def test_bad_grammar_and_bad_tools_are_400(stack: Stack, client: openai.OpenAI) -> None:
    url = f"{stack.urls[0]}/v1/chat/completions"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        # Compile without the vocabulary, not with it: they ended as an empty "stop" (200).
        ({"structured_outputs": {"grammar": "start: <[99999]>"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: <|nonexistent|>"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 5, **extra}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="", prompt="x", extra_body={"structured_outputs": {"regex": "("}})
    # The stack keeps serving.
    assert client.completions.create(model="", prompt="x", max_tokens=2).choices[0].finish_reason == "length"


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, seed=5)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named: Any = {"type": "function", "function": {"name": "add"}}
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=100, seed=6)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1 and calls[0].function.name == "add"
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas["add"])
    # Streamed: the name and id once, then the arguments in pieces that join to the response's.
    stream = client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=100, seed=6, stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(name, arguments) for _, name, arguments in joined_calls(deltas)] == [("add", calls[0].function.arguments)]  # type: ignore[union-attr]
    # "none" is plain text; "auto" (the default with tools) needs a gateway with a tool-call parser: a 400
    # here, as from vLLM without one.
    plain = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
        client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=3)
    # The calls and their results go back in the next turn (rendered by the chat template).
    call = calls[0]
    turn = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    reply = client.chat.completions.create(model="", messages=turn, tools=TOOLS, tool_choice="none", max_tokens=3)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "length"


def joined_calls(deltas: list[Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call streamed in ``deltas``: the id and name come once, in
    the call's first entry, the arguments in pieces."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.function.name is None
            calls[tc.index][2] += tc.function.arguments or ""
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]


@pytest.fixture(scope="module")
def auto_url(stack: Stack) -> str:
    """A second gateway on the stack, started with vLLM's flags for "auto" tool calls and reasoning."""
    stack.ports.append(free_port())
    i = len(stack.ports) - 1
    proc = stack.spawn_gateway(
        i, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"
    )
    wait_healthy(f"{stack.urls[i]}/health", 60, [proc])
    return stack.urls[i]


# The random model would not write a call of its own: a regex makes it write one in Hermes' format,
# which the parser then finds (vLLM applies such a constraint under "auto" too).
FORCED = r'Checking\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>'


def test_auto_tool_choice_reads_the_calls_the_model_writes(stack: Stack, auto_url: str) -> None:
    client = openai.OpenAI(base_url=f"{auto_url}/v1", api_key="unused", max_retries=0, timeout=60)
    forced: Any = {"structured_outputs": {"regex": FORCED}}
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=forced)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    calls = choice.message.tool_calls
    assert calls and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]  # type: ignore[union-attr]
    # Streamed: the content as it comes, then the call in pieces (hermes streams its arguments).
    chunks = list(
        client.chat.completions.create(
            model="", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=forced, stream=True, tool_choice="auto"
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking.\n"
    assert len([d for d in deltas if d.tool_calls]) > 1
    assert [(name, arguments) for _, name, arguments in joined_calls(deltas)] == [("add", calls[0].function.arguments)]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without a call in the output, "auto" is plain content.
    plain = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    # Special tokens are kept under "auto", but not the EOS that ended the output (vLLM's rule):
    # "Hello there<|im_end|>" was the content, and a call the model ended without its end tag none.
    hello = client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, max_tokens=50, extra_body={"structured_outputs": {"regex": "Hello there"}}
    )
    assert hello.choices[0].message.content == "Hello there" and hello.choices[0].finish_reason == "stop"
    unclosed: Any = {"structured_outputs": {"regex": FORCED.removesuffix(r"\n</tool_call>")}}
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=unclosed)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.tool_calls[0].function.name == "add"  # type: ignore[index]


def test_a_stream_with_auto_tool_calls_resumes_on_a_gateway_without_the_parser(stack: Stack, auto_url: str) -> None:
    """The journal names the parser the stream was accepted with: the first gateway has none."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "stream": True, "structured_outputs": {"regex": FORCED}}
    with httpx.stream("POST", f"{auto_url}/v1/chat/completions", json=body, headers={"X-Request-Id": "auto-tools-1"}) as r:
        assert r.status_code == 200
        first = r.read().decode()
    replay = httpx.get(f"{stack.urls[0]}/v1/streams/auto-tools-1", headers={"Last-Event-ID": "0"}, timeout=60)
    assert replay.status_code == 200 and replay.text == first
    assert '"tool_calls":[{"index":0' in first and '"finish_reason":"tool_calls"' in first


# The same call in the formats of the parsers that re-read their calls' text as it grows.
WRITTEN = {
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris, the capital of France", "days": 3}'
    '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    "pythonic": '[get_weather(city="Paris, the capital of France", days=3), add(a=1, b=2)]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, the capital of France\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n"
    "</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("parser", sorted(WRITTEN))
def test_every_parser_streams_its_calls_in_pieces_and_a_resumed_stream_replays_them(stack: Stack, parser: str) -> None:
    """mistral, pythonic and qwen3_coder stream each call's arguments in pieces (a string as it
    comes), which join to the response's; a stream resumed on a gateway without the parser replays
    the same bytes."""
    stack.ports.append(free_port())
    i = len(stack.ports) - 1
    proc = stack.spawn_gateway(i, "--enable-auto-tool-choice", "--tool-call-parser", parser)
    try:
        wait_healthy(f"{stack.urls[i]}/health", 60, [proc])
        client = openai.OpenAI(base_url=f"{stack.urls[i]}/v1", api_key="unused", max_retries=0, timeout=60)
        forced: Any = {"structured_outputs": {"regex": re.escape(WRITTEN[parser])}}
        out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=300, extra_body=forced)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls is not None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
            ("get_weather", {"city": "Paris, the capital of France", "days": 3}),
            ("add", {"a": 1, "b": 2}),
        ]
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "stream": True, **forced}
        with httpx.stream(
            "POST", f"{stack.urls[i]}/v1/chat/completions", json=body, headers={"X-Request-Id": f"{parser}-pieces"}
        ) as r:
            assert r.status_code == 200
            first = r.read().decode()
        chunks = [json.loads(line[6:]) for line in first.split("\n") if line.startswith("data: {")]
        deltas = [openai.types.chat.ChatCompletionChunk.model_validate(c).choices[0].delta for c in chunks if c["choices"]]
        assert len([d for d in deltas if d.tool_calls and d.tool_calls[0].index == 0]) > 2  # (in pieces)
        assert [(n, a) for _, n, a in joined_calls(deltas)] == [(c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]
        replay = httpx.get(f"{stack.urls[0]}/v1/streams/{parser}-pieces", headers={"Last-Event-ID": "0"}, timeout=60)
        assert replay.status_code == 200 and replay.text == first
    finally:
        proc.kill()
        proc.wait()


def test_a_reasoning_parser_takes_the_thinking_out_of_the_content(stack: Stack, auto_url: str) -> None:
    """deepseek_r1: the output is reasoning up to a ``</think>``, which the random model never
    writes: all of it is reasoning (as a thinking model's cut by the length limit)."""
    plain_client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)
    client = openai.OpenAI(base_url=f"{auto_url}/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs: Any = dict(model="", messages=MESSAGES, max_tokens=8, temperature=0)
    text = plain_client.chat.completions.create(**kwargs).choices[0].message.content
    assert text
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content is None and message.reasoning == message.reasoning_content == text  # type: ignore[attr-defined]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == text and not any(d.content for d in deltas)
    hidden = client.chat.completions.create(**kwargs, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content is None and not hasattr(hidden, "reasoning")
    # A prefilled answer past its thinking: the output goes on with the answer (it was all reasoning).
    prefilled = [*MESSAGES, {"role": "assistant", "content": "<think>Easy.</think>The answer is"}]
    go_on: Any = {"add_generation_prompt": False, "continue_final_message": True}
    answer = client.chat.completions.create(**{**kwargs, "messages": prefilled}, extra_body=go_on).choices[0].message
    assert answer.content and not hasattr(answer, "reasoning")


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=4)


class Forecast(BaseModel):
    place: Place
    unit: Unit
    days: int = Field(ge=1, le=9)


class Alarm(BaseModel):
    unit: Unit
    above: int = Field(ge=-50, le=50)


PYDANTIC_TOOLS: Any = [
    {"type": "function", "function": {"name": "forecast", "parameters": Forecast.model_json_schema()}},
    {"type": "function", "function": {"name": "alarm", "parameters": Alarm.model_json_schema()}},
]


def test_pydantic_tools_with_defs_under_required_stream_and_resume(stack: Stack, client: openai.OpenAI, auto_url: str) -> None:
    """Tools whose parameters hold ``$defs`` (an enum, a nested model): a 200 whose calls
    validate; streamed, pieces that join to the same calls; replayed on another gateway, the same
    events."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in PYDANTIC_TOOLS}
    kwargs: Any = dict(model="", messages=MESSAGES, tools=PYDANTIC_TOOLS, tool_choice="required", max_tokens=300, seed=7)
    out = client.chat.completions.create(**kwargs)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len([d for d in deltas if d.tool_calls]) > 1  # in pieces, not whole at the end
    want = [(c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]
    assert [(name, arguments) for _, name, arguments in joined_calls(deltas)] == want
    body = {
        "messages": MESSAGES,
        "tools": PYDANTIC_TOOLS,
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": 7,
        "stream": True,
    }
    with httpx.stream("POST", f"{stack.urls[0]}/v1/chat/completions", json=body, headers={"X-Request-Id": "defs-1"}) as r:
        assert r.status_code == 200
        first = r.read().decode()
    replay = httpx.get(f"{auto_url}/v1/streams/defs-1", headers={"Last-Event-ID": "0"}, timeout=60)
    assert replay.status_code == 200 and replay.text == first
    # One definition name with two schemas: a 400 naming it.
    clash: Any = [
        *PYDANTIC_TOOLS[:1],
        {
            "type": "function",
            "function": {
                "name": "other",
                "parameters": {
                    "type": "object",
                    "properties": {"u": {"$ref": "#/$defs/Unit"}},
                    "$defs": {"Unit": {"type": "integer"}},
                },
            },
        },
    ]
    with pytest.raises(openai.BadRequestError, match="Unit") as info:
        client.chat.completions.create(**{**kwargs, "tools": clash})
    assert info.value.body is not None and info.value.body.get("param") == "tools"  # type: ignore[union-attr]


def test_a_forced_tool_choice_overrides_response_format(client: openai.OpenAI) -> None:
    """The OpenAI Agents SDK sends both (an agent with an output type and tool_choice "required")."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model="", messages=MESSAGES, tools=PYDANTIC_TOOLS, tool_choice="required", response_format=fmt, max_tokens=300, seed=8
    )
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.tool_calls


OPEN_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


def test_schemas_are_closed_by_default_and_the_request_may_open_them(client: openai.OpenAI) -> None:
    """No ``additionalProperties``: only the listed key (vLLM's default backend's strict mode);
    vLLM's ``disable_additional_properties: false`` compiles the schema as JSON Schema reads it."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "n", "schema": OPEN_SCHEMA}}
    for seed in range(3):
        out = client.chat.completions.create(model="", messages=MESSAGES, response_format=fmt, max_tokens=60, seed=seed)
        value = json.loads(out.choices[0].message.content or "")
        assert set(value) == {"n"}
    opened = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        response_format=fmt,
        max_tokens=60,
        seed=0,
        extra_body={"structured_outputs": {"disable_additional_properties": False}},
    )
    assert opened.choices[0].finish_reason in ("stop", "length")
    if opened.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(opened.choices[0].message.content or ""), OPEN_SCHEMA)
