"""The Responses API's pure parts: a Responses body mapped to a chat request (input items, tools,
``text.format``), the response object built from a chat completion, and the typed events of a
stream built from chat chunks (their order, numbering, and agreement with the final object)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import fakeredis
import pytest

from common.protocol import Names
from common.transport import Transport
from gateway.http.errors import ApiError
from gateway.openai.schema import ChatParsers, parse_chat
from gateway.responses.events import ResponseEvents, chat_chunks, typed_sse
from gateway.responses.objects import ResponseShell, history_messages, item_id
from gateway.responses.request import parse_responses
from gateway.responses.store import ResponseStore

pytestmark = pytest.mark.unit

TOOL = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    req = parse_responses({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7})
    body = req.chat_body([])
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert body["max_tokens"] == 7 and body["model"] == "m" and "stream" not in body
    spec = parse_chat(body)
    assert spec.max_tokens == 7 and spec.messages is not None and len(spec.messages) == 2
    # An earlier turn goes between the instructions and this turn's input (its own instructions do not).
    earlier = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert [m["content"] for m in req.chat_body(earlier)["messages"]] == ["Be brief.", "Q", "A", "Hi"]


def test_input_items_map_to_chat_messages_with_tool_calls_and_results() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "1+"}, {"type": "input_text", "text": "2?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "4"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "3 and 4"}]},
    ]
    messages = parse_responses({"input": items}).messages
    assert messages == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "4"},
        {"role": "assistant", "content": "3 and 4"},
    ]
    parse_chat({"messages": messages})  # chat takes them as they are


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "input", "'input' must be"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "image_generation_call"}]}, "input", "not supported"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input", "text part"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tool"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format", "schema"),
        ({"input": "x", "background": True, "store": False}, "background", "requires 'store'"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt", "not supported"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_responses(body)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_flat_tools_tool_choice_and_text_format_map_to_chat() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    req = parse_responses(
        {
            "input": "x",
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "add"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        }
    )
    chat = req.chat_body([])
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    assert req.tools == [TOOL] and req.tool_choice == {"type": "function", "name": "add"}  # echoed as sent
    spec = parse_chat({**chat, "response_format": None})
    assert spec.structured is not None and spec.structured.tool_call is not None and spec.structured.tool_call.name == "add"
    assert parse_responses({"input": "x", "text": {"format": {"type": "json_object"}}}).chat["response_format"] == {
        "type": "json_object"
    }
    # Tools default to "auto", which (as in chat) needs a tool-call parser.
    auto = parse_responses({"input": "x", "tools": [TOOL]}).chat_body([])
    assert auto["tool_choice"] == "auto"
    parse_chat(auto, ChatParsers(tools="hermes"))
    with pytest.raises(ApiError, match="tool-call-parser"):
        parse_chat(auto)


def _shell(**body: Any) -> ResponseShell:
    return ResponseShell("resp_1", 100, "tiny", parse_responses({"input": "x", **body}))


def test_a_chat_completion_becomes_a_response_with_items_and_usage() -> None:
    chat = {
        "created": 5,
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "Sure.",
                    "reasoning": "Think.",
                    "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10},
    }
    out = _shell(max_output_tokens=9, metadata={"k": "v"}).from_chat(chat)
    assert out["object"] == "response" and out["status"] == "completed" and out["id"] == "resp_1"
    assert out["max_output_tokens"] == 9 and out["metadata"] == {"k": "v"} and out["store"] is True
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    reasoning, message, call = out["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Think."}]
    assert message["content"] == [{"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]
    assert call["call_id"] == "call_9" and call["id"] == item_id("resp_1", "fc", 0) and call["arguments"] == "{}"
    assert out["usage"]["input_tokens"] == 4 and out["usage"]["output_tokens"] == 6 and out["usage"]["total_tokens"] == 10
    assert out["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    # The next turn continues after the text and the calls, not the reasoning.
    assert history_messages(out["output"]) == [
        {"role": "assistant", "content": "Sure.", "tool_calls": [chat["choices"][0]["message"]["tool_calls"][0]]}  # type: ignore[index]
    ]
    cut = {**chat, "choices": [{"message": {"role": "assistant", "content": "ab"}, "finish_reason": "length"}]}
    short = _shell().from_chat(cut)
    assert short["status"] == "incomplete" and short["incomplete_details"] == {"reason": "max_output_tokens"}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


def test_stream_events_come_in_openais_order_and_join_to_the_final_response() -> None:
    events = ResponseEvents(_shell())
    out = events.start()
    for chunk in [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "Hm"}),
        _chunk({"reasoning": "m."}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk(
            {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a"'}}]}
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        _chunk(
            {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
            "tool_calls",
        ),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}},
    ]:
        out += events.feed(chunk)
    out += events.finish()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = out[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 8
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    # The deltas join to the final items, and every event names its item and place.
    text = "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta")
    assert text == "Hello" == final["output"][1]["content"][0]["text"]
    args = "".join(e["delta"] for e in out if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == 2)
    assert args == '{"a": 1}' == final["output"][2]["arguments"] and final["output"][2]["call_id"] == "call_1"
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3] and added[1]["item"]["status"] == "in_progress"
    assert {e["item_id"] for e in out if e["type"] == "response.output_text.delta"} == {final["output"][1]["id"]}


def test_a_stream_cut_by_the_length_limit_is_incomplete_and_an_error_fails_it() -> None:
    events = ResponseEvents(_shell())
    out = [*events.start(), *events.feed(_chunk({"content": "ab"}, "length")), *events.finish()]
    assert out[-1]["type"] == "response.incomplete" and out[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    failing = ResponseEvents(_shell())
    failing.start()
    failing.feed(_chunk({"content": "a"}))
    out = failing.feed({"error": {"message": "engine gone", "type": "server_error", "code": "engine_error"}})
    assert [e["type"] for e in out][-1] == "response.failed"
    assert out[-1]["response"]["error"] == {"code": "engine_error", "message": "engine gone"}
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "a"  # what streamed is kept


def test_typed_sse_and_chat_chunks_round_trip() -> None:
    event = {"type": "response.output_text.delta", "sequence_number": 3, "delta": "é\n"}
    text = typed_sse(event)
    assert text.startswith("event: response.output_text.delta\ndata: ") and text.endswith("\n\n")
    assert json.loads(text.split("data: ", 1)[1]) == event
    chat = 'id: 1\ndata: {"a":1}\n\nid: 2\ndata: {"b":"x\\n"}\n\nid: 3\ndata: [DONE]\n\n'
    assert chat_chunks(chat) == [{"a": 1}, {"b": "x\n"}]


def test_a_background_response_s_events_are_kept_in_order_with_a_ttl_and_go_with_it() -> None:
    """`ResponseStore`'s event stream: appended in order, read after a cursor (all, or the newer
    ones), with the stored response's TTL; deleting the response deletes them."""

    async def run() -> None:
        transport = Transport("redis://unused", Names("t-events"))
        transport.redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
        store = ResponseStore(transport, transport.names, 60_000)
        shell = ResponseShell("resp_1", 1, "m", parse_responses({"input": "x", "background": True, "stream": True}))
        events = ResponseEvents(shell)
        first = events.start()
        record = {"status": "completed", "owner": "alice", "response": "{}", "history": "[]"}  # (fakeredis runs no Lua)
        await transport.redis.hset(transport.names.response("resp_1"), mapping=record)
        assert not await store.has_events("resp_1")
        await store.append_events("resp_1", first)
        await store.append_events("resp_1", [])
        assert await store.has_events("resp_1")
        key = transport.names.response_events("resp_1")
        assert 0 < await transport.redis.pttl(key) <= 60_000
        read = await store.read_events("resp_1", b"0-0", None)
        assert [e for _, e in read] == first and [e["sequence_number"] for _, e in read] == [0, 1]
        last = events.feed({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}) + events.finish()
        await store.append_events("resp_1", last)
        newer = await store.read_events("resp_1", read[-1][0], None)
        assert [e for _, e in newer] == last and newer[-1][1]["type"] == "response.completed"
        assert await store.read_events("resp_1", newer[-1][0], None) == []
        assert await store.delete("resp_1", "alice") and not await store.has_events("resp_1")

    asyncio.run(run())
