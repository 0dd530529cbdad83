"""Structured outputs and tool calls through the real stack (processes, Redis, HTTP) with the real
`openai` client: the tiny random checkpoint's output is arbitrary, but must obey the constraint."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from infra.stack import Stack

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
    # Streamed: the calls come whole in the final chunk.
    stream = client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=100, seed=6, stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("add", calls[0].function.arguments)]  # type: ignore[union-attr]
    # "none" is plain text; "auto" (the default with tools) needs a tool-call parser: a 400, as from vLLM without one.
    plain = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="tool-call parser"):
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
