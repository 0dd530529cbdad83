"""The gateway's structured-output fields (`gateway.openai.structured`) and tool-call responses
(`gateway.output.tool_calls`), without an engine: what each body becomes, and the 400s (grammars are
checked against the tiny checkpoint's vocabulary, as a gateway checks them against its model's)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from common.structured_outputs import grammar_tokenizer
from gateway.http.errors import ApiError
from gateway.openai.chat_messages import TemplateOptions
from gateway.openai.schema import parse_chat, parse_completion
from gateway.openai.structured import check_grammar
from gateway.output.tool_calls import tool_calls

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "hi"}]
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model())


VOCAB = 1024  # the tiny checkpoint's


def _chat(**body: Any) -> Any:
    return parse_chat({"messages": MESSAGES, **body})


def _error(fn: Any, body: dict[str, Any], tokenizer: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        spec = fn(body)
        check_grammar(spec.sampling, spec.structured, tokenizer, threading.Lock(), VOCAB)
    assert info.value.status == 400
    return info.value


def test_each_field_becomes_one_constraint(tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
            {"json": json.dumps(schema, separators=(",", ":"))},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a", "b"], "disable_fallback": True}}, {"choice": ["a", "b"]}, "structured_outputs"),
        ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}, "guided_grammar"),
    ]
    for extra, wire, param in cases:
        for spec in (_chat(**extra), parse_completion({"prompt": "p", **extra})):
            assert spec.sampling.structured_outputs is not None and spec.sampling.structured_outputs.to_dict() == wire
            assert spec.structured is not None and spec.structured.param == param
            check_grammar(spec.sampling, spec.structured, tokenizer, threading.Lock(), VOCAB)
    plain = _chat(response_format={"type": "text"}, tools=[ADD], tool_choice="none")
    assert plain.sampling.structured_outputs is None and plain.structured is not None and plain.structured.tool_call is None


def test_malformed_or_conflicting_fields_are_400(tokenizer: Any) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs"),
        ({"structured_outputs": {"whatever": 1}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": {"add": ADD}}, "tools"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": "auto"}, "tool_choice"),  # no tool-call parser here (vLLM's 400 too)
        ({"tools": [ADD]}, "tool_choice"),  # "auto" is the default with tools
        ({"structured_outputs": {"regex": "a", "disable_additional_properties": "no"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_additional_properties": 0}},
            "structured_outputs",
        ),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # (served, but not streamed)
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),  # these four are refused, not ignored
        ({"logits_processors": ["my.module:Processor"]}, "logits_processors"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": ["add"]}}}, "tool_choice"),  # not a 500
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": {"x": 1}}}}, "tool_choice"),
        ({"functions": [ADD["function"]]}, "functions"),
    ]
    for extra, param in cases:
        assert _error(parse_chat, {"messages": MESSAGES, **extra}, tokenizer).param == param, extra
    assert _error(parse_completion, {"prompt": "p", "guided_regex": "("}, tokenizer).code == "invalid_grammar"
    outside = _error(parse_completion, {"prompt": "p", "guided_grammar": f"start: <[{VOCAB}]>"}, tokenizer)
    assert outside.code == "invalid_grammar" and "Token range" in outside.message
    # A tokenizer llguidance cannot read (a slow one) leaves the check without the vocabulary, not a 500.
    unreadable = SimpleNamespace()
    assert grammar_tokenizer(unreadable, VOCAB) is None
    spec = parse_completion({"prompt": "p", "guided_grammar": 'start: "x"'})
    check_grammar(spec.sampling, spec.structured, unreadable, threading.Lock(), VOCAB)


def test_tool_choice_constraints_and_calls() -> None:
    required = _chat(tools=[ADD], tool_choice="required")
    schema = json.loads(required.sampling.structured_outputs.to_dict()["json"])
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["add"]}
    assert required.structured.tool_call.kind == "required"
    text = '[{"name":"add","parameters":{"a":1}}]'
    calls = tool_calls(required.structured.tool_call, text, "chatcmpl-1", 1700000000, 0)
    assert calls is not None and calls[0]["function"] == {"name": "add", "arguments": '{"a":1}'}
    assert calls == tool_calls(required.structured.tool_call, text, "chatcmpl-1", 1700000000, 0)  # a resumed stream's
    # Another choice, or another response under the same (client-chosen) id later: other ids.
    others = [
        tool_calls(required.structured.tool_call, text, "chatcmpl-1", 1700000000, 1),
        tool_calls(required.structured.tool_call, text, "chatcmpl-1", 1700000060, 0),
    ]
    assert len({c[0]["id"] for c in [calls, *others] if c}) == 3
    named = _chat(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert json.loads(named.sampling.structured_outputs.to_dict()["json"]) == ADD["function"]["parameters"]
    calls = tool_calls(named.structured.tool_call, '{"a":2}', "chatcmpl-2", 1700000000, 0)
    assert calls is not None and calls[0]["function"] == {"name": "add", "arguments": '{"a":2}'}
    assert tool_calls(named.structured.tool_call, '{"a":', "chatcmpl-2", 1700000000, 0) is None  # cut short
    # A lone surrogate no UTF-8 response holds (a 500 before): the text, as content, as it came.
    lone = '[{"name":"add","parameters":{"a":"\\ud800"}}]'
    assert tool_calls(required.structured.tool_call, lone, "chatcmpl-1", 1700000000, 0) is None
    # Nested past the interpreter's recursion limit (a tool's schema can force it): the text comes
    # back as content, not a 500 (a cut stream, streamed).
    deep = "[" * 100_000 + "0" + "]" * 100_000
    assert tool_calls(named.structured.tool_call, deep, "chatcmpl-3", 1700000000, 0) is None
    assert tool_calls(required.structured.tool_call, f'[{{"name":"add","parameters":{deep}}}]', "c", 1, 0) is None


def test_a_failure_while_streaming_ends_the_stream_with_an_error_event_and_done() -> None:
    """Not a cut connection, which clients read as a network fault and retry."""
    import asyncio

    from gateway.output.streaming import stream_choices

    async def pieces() -> Any:
        yield SimpleNamespace(finish_reason=None)

    def broken(piece: Any) -> list[dict[str, Any]]:
        raise RuntimeError("a formatting bug")

    gen = SimpleNamespace(pieces=pieces, num_completion_tokens=1)
    fmt = SimpleNamespace(stream_start=lambda: [{"id": "x"}], stream_piece=broken, request_id="cmpl-x")

    async def read() -> list[str]:
        return [event async for event in stream_choices([gen], [fmt], fmt, 1)]  # type: ignore[list-item, arg-type]

    events = "".join(asyncio.run(read()))
    assert '"type":"server_error"' in events.replace(" ", "") and events.endswith("data: [DONE]\n\n")


def test_tool_use_round_trips_through_the_messages() -> None:
    """The assistant's calls and the tools' answers reach the chat template (vLLM's shapes), and
    ``parallel_tool_calls: false`` allows one call."""
    from gateway.openai.schema import parse_tokenize

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "42"},
    ]
    spec = _chat(messages=messages, tools=[ADD], tool_choice="none")
    assert spec.messages is not None and spec.messages[-2:] == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "name": "add", "tool_call_id": "call_1"},
    ]
    # The reasoning a response gave goes back to the template under both names (they read either).
    for key in ("reasoning", "reasoning_content"):
        thought = _chat(messages=[*MESSAGES, {"role": "assistant", "content": "4", key: "2+2"}]).messages
        assert thought is not None and thought[-1] == {
            "role": "assistant",
            "content": "4",
            "reasoning": "2+2",
            "reasoning_content": "2+2",
        }
    assert spec.messages[-2:] == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "name": "add", "tool_call_id": "call_1"},
    ]
    deep = "[" * 600 + "]" * 600  # 1.2 KB: a template walking it would pass the recursion limit
    for bad_message in (
        {"role": "user", "content": "x", "tool_calls": [call]},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "add", "arguments": "{"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "add", "arguments": deep}}]},
        {"role": "user", "content": "x", "tool_call_id": "call_1"},
        {"role": "user", "content": "x", "reasoning": "y"},
        {"role": "assistant", "content": "x", "reasoning_content": ["y"]},
    ):
        with pytest.raises(ApiError):
            _chat(messages=[*MESSAGES, bad_message])
    one = _chat(tools=[ADD], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(one.sampling.structured_outputs.to_dict()["json"])["maxItems"] == 1
    assert parse_tokenize({"messages": MESSAGES, "tools": []}).messages == MESSAGES  # no tools, as for chat


def test_a_falsy_second_constraint_and_a_bad_second_max_tokens_are_400() -> None:
    for body in ({"structured_outputs": {"json": 0, "regex": "a"}}, {"structured_outputs": {"choice": 0, "regex": "a"}}):
        with pytest.raises(ApiError, match="exactly one"):
            _chat(**body)
    with pytest.raises(ApiError, match="max_tokens"):
        _chat(max_completion_tokens=1, max_tokens="lots")


def test_a_template_that_cannot_render_a_message_is_a_400() -> None:
    """A template that concatenates a call's arguments as a string (as some do) meets an object."""
    from gateway.openai.chat_messages import chat_text

    tok = SimpleNamespace(chat_template="x", apply_chat_template=lambda *a, **k: "x" + {"a": 1})  # type: ignore[operator]
    with pytest.raises(ApiError, match="chat template rejected"):
        chat_text(tok, MESSAGES, TemplateOptions())


def test_vllms_refused_hooks_are_fine_when_empty() -> None:
    """Refused unless neutral: null or empty, as a client that always sends the keys has them."""
    parse_completion({"prompt": "p", "logits_processors": [], "kv_transfer_params": {}, "vllm_xargs": {}, "prompt_embeds": None})
