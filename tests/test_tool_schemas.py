"""Tool schemas as clients send them: JSON schemas closed by default (`common.strict_json_schema`,
checked with llguidance on a byte vocabulary), tools' ``$defs`` lifted to the wrapper's root
(`gateway.openai.tool_grammar`), a forced tool over ``response_format``, and tool calls streamed
in pieces that join to the non-streamed response's arguments (`gateway.output.call_deltas`)."""

from __future__ import annotations

import enum
import json
import random
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from pydantic import BaseModel

from common.strict_json_schema import close_schema
from common.structured_outputs import StructuredOutputsParams
from gateway.http.errors import ApiError
from gateway.openai.schema import parse_chat
from gateway.openai.structured import ToolCallMode
from gateway.openai.tool_grammar import ToolSchemaError, required_calls_schema
from gateway.output.call_deltas import CallScanner, join_pieces
from gateway.output.generation import Piece
from gateway.output.responses import ResponseFormatter
from gateway.output.tool_calls import ConstrainedCallStream, tool_calls

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hi"}]


class ByteVocabulary:
    """A vocabulary of the 256 bytes and an EOS: any text is a token sequence, one byte a token."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = LLTokenizer(TokenizerWrapper(ByteVocabulary()))


def accepts(spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar of ``spec`` lets the output be exactly ``text``."""
    matcher = LLMatcher(BYTES, spec.llguidance_grammar(), log_level=0)
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(BaseModel):
    city: str
    country: str


class Forecast(BaseModel):
    place: Place
    unit: Unit
    days: int


class Alarm(BaseModel):
    unit: Unit
    threshold: float


def function(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_schemas_close_where_they_say_nothing() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
            "list": {"type": "array", "items": {"properties": {"x": {"const": {"y": 1}}}}},
            "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        },
        "$defs": {"D": {"type": "object"}},
    }
    before = json.dumps(schema)
    closed = close_schema(schema)
    assert json.dumps(schema) == before  # the request's own schema is left as it came
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and props["map"]["additionalProperties"] == {"type": "integer"}
    assert props["pair"]["items"] is False and props["list"]["items"]["additionalProperties"] is False
    assert props["list"]["items"]["properties"]["x"] == {"const": {"y": 1}}  # data, not a schema
    assert all("additionalProperties" not in s for s in props["both"]["allOf"])  # judged merged
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert close_schema(True) is True
    unlisted = {"type": "object", "required": ["x"]}  # closed, it would admit no object at all
    assert close_schema(unlisted) == unlisted


def test_an_unlisted_key_is_refused_unless_the_request_opens_objects() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    strict, opened = (
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(json=schema, disable_additional_properties=False),
    )
    assert accepts(strict, '{"a":1}') and not accepts(strict, '{"a":1,"b":2}')
    assert accepts(opened, '{"a":1,"b":2}')
    pair = {"type": "array", "prefixItems": [{"type": "integer"}]}
    assert accepts(StructuredOutputsParams(json=pair), "[1]") and not accepts(StructuredOutputsParams(json=pair), "[1,2]")
    # The option travels to the executor only when it departs from the default.
    assert "disable_additional_properties" not in strict.to_dict()
    wire = opened.to_dict()
    assert wire["disable_additional_properties"] is False and StructuredOutputsParams.from_dict(wire).key() == opened.key()
    # Over HTTP: vLLM's field, alone beside response_format (or a tool), opens the objects.
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for body in ({"response_format": fmt}, {"tools": [function("f", schema)], "tool_choice": "required"}):
        closed = parse_chat({"messages": MESSAGES, **body}).sampling.structured_outputs
        opened_spec = parse_chat(
            {"messages": MESSAGES, **body, "structured_outputs": {"disable_additional_properties": False}}
        ).sampling.structured_outputs
        assert closed is not None and closed.disable_additional_properties
        assert opened_spec is not None and not opened_spec.disable_additional_properties


def test_pydantic_defs_lift_to_the_root_of_the_required_schema() -> None:
    forecast, alarm = Forecast.model_json_schema(), Alarm.model_json_schema()
    assert "$defs" in forecast and "$defs" in alarm  # (both define Unit, identically)
    spec = parse_chat(
        {"messages": MESSAGES, "tools": [function("forecast", forecast), function("alarm", alarm)], "tool_choice": "required"}
    )
    assert spec.sampling.structured_outputs is not None
    schema = spec.sampling.structured_outputs.json_schema()
    assert set(schema["$defs"]) == {"Place", "Unit"}
    assert all("$defs" not in call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    calls = [
        {"name": "forecast", "parameters": {"place": {"city": "Paris", "country": "FR"}, "unit": "celsius", "days": 3}},
        {"name": "alarm", "parameters": {"unit": "fahrenheit", "threshold": 1.5}},
    ]
    jsonschema.validate(calls, schema)
    text = json.dumps(calls, separators=(",", ":"))
    assert accepts(spec.sampling.structured_outputs, text)
    assert not accepts(spec.sampling.structured_outputs, text.replace("fahrenheit", "kelvin"))
    # A local reference into the tool's own schema follows it into the wrapper.
    recursive = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]}
    wrapper = required_calls_schema({"f": forecast, "chain": recursive}, at_most_one=True)
    assert wrapper["maxItems"] == 1
    assert wrapper["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["next"]["anyOf"][0] == {
        "$ref": "#/items/anyOf/1/properties/parameters"
    }
    jsonschema.validate([{"name": "chain", "parameters": {"next": {"next": None}}}], wrapper)


def test_one_definition_name_with_two_schemas_is_a_400_naming_it() -> None:
    other_unit = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": {"type": "integer"}}}
    with pytest.raises(ToolSchemaError, match=r"'forecast' and 'other' both define \$defs/Unit"):
        required_calls_schema({"forecast": Forecast.model_json_schema(), "other": other_unit}, at_most_one=False)
    tools = [function("forecast", Forecast.model_json_schema()), function("other", other_unit)]
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
    assert info.value.status == 400 and info.value.param == "tools" and "Unit" in info.value.message


def test_a_forced_tool_overrides_response_format() -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
    }
    named = {"type": "function", "function": {"name": "forecast"}}
    for choice in ("required", named):
        body = {"messages": MESSAGES, "tools": [function("forecast", Forecast.model_json_schema())], "tool_choice": choice}
        spec = parse_chat({**body, "response_format": fmt})
        assert spec.structured is not None and spec.structured.param == "tools"
        assert spec.sampling.structured_outputs is not None
        assert spec.sampling.structured_outputs.key() == parse_chat(body).sampling.structured_outputs.key()  # type: ignore[union-attr]


REQUIRED_TEXTS = [
    '[{"name":"add","parameters":{"a":1,"s":"x\\"}{,]","l":[{"q":[]}]}},{"name":"w","parameters":{}}]',
    '[{"name":"a\\"b","parameters":{"k":"\\u00e9"}}]',
    '[{"name":"f","parameters":[1,{"x":"}"}]},{"name":"g","parameters":3}]',
]


def _joined(deltas: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call streamed in ``deltas``, its pieces joined."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", []):
            if "id" in entry:
                assert entry["index"] not in calls  # the name and id go out once
                calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
            calls[entry["index"]][2] += entry["function"]["arguments"]
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())]


def _stream(mode: ToolCallMode, text: str, rng: random.Random, finish: str = "stop") -> tuple[list[dict[str, Any]], str | None]:
    stream, deltas, at, reason = ConstrainedCallStream(mode), [], 0, None
    while at < len(text) or not deltas:
        step = rng.randint(0, 7)
        piece, at = text[at : at + step], at + step
        delta, reason = stream.delta(piece, finish if at >= len(text) else None, ("chatcmpl-1", 1700000000, 0))
        deltas.append(delta)
    return deltas, reason


def test_streamed_pieces_join_to_the_response_under_any_split() -> None:
    rng = random.Random(0)
    required = ToolCallMode("required")
    for text in REQUIRED_TEXTS:
        want = tool_calls(required, text, "chatcmpl-1", 1700000000, 0)
        assert want is not None
        assert [json.loads(c["function"]["arguments"]) for c in want] == [c["parameters"] for c in json.loads(text)]
        for _ in range(50):
            deltas, reason = _stream(required, text, rng)
            assert reason == "tool_calls"
            assert _joined(deltas) == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in want]
    named = ToolCallMode("named", "add")
    text = '{"a":1,"b":"x"}'
    want = tool_calls(named, text, "chatcmpl-1", 1700000000, 0)
    assert want is not None
    for _ in range(20):
        deltas, reason = _stream(named, text, rng)
        assert reason == "tool_calls" and _joined(deltas) == [(want[0]["id"], "add", text)]
    # A call without parameters reads as {}, streamed too.
    scanner = CallScanner()
    assert join_pieces([*scanner.feed('[{"name":"f"}]'), *scanner.finish()]) == [("f", "{}")]


def test_pieces_go_out_as_they_are_generated() -> None:
    stream = ConstrainedCallStream(ToolCallMode("required"))
    ids = ("chatcmpl-1", 1700000000, 0)
    assert stream.delta('[{"name":"ad', None, ids) == ({}, None)  # the name is not known yet
    first, _ = stream.delta('d","parameters":{"a"', None, ids)
    entry = first["tool_calls"][0]
    assert entry["index"] == 0 and entry["type"] == "function" and entry["id"].startswith("chatcmpl-tool-")
    assert entry["function"] == {"name": "add", "arguments": '{"a"'}
    assert stream.delta(":12", None, ids) == ({"tool_calls": [{"index": 0, "function": {"arguments": ":12"}}]}, None)
    last, reason = stream.delta("}}]", "stop", ids)
    assert reason == "tool_calls" and last == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    # Cut short before any name: the text comes as content, as the response answers it.
    cut = ConstrainedCallStream(ToolCallMode("required"))
    assert cut.delta('[{"na', None, ids) == ({}, None)
    assert cut.delta('me":"a', "length", ids) == ({"content": '[{"name":"a'}, "length")
    # Cut short inside the arguments: the pieces sent, and the reason, as vLLM streams it.
    named = ConstrainedCallStream(ToolCallMode("named", "add"))
    delta, reason = named.delta('{"a":', "length", ids)
    assert reason == "length" and delta["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":'}


def test_a_formatter_streams_and_replays_the_same_events() -> None:
    """A resumed stream formats the journaled pieces again: the same events, ids included."""
    body = {"messages": MESSAGES, "tools": [function("forecast", Forecast.model_json_schema())], "tool_choice": "required"}
    text = '[{"name":"forecast","parameters":{"place":{"city":"Paris","country":"FR"},"unit":"celsius","days":3}}]'
    pieces = [Piece(text[:20]), Piece(text[20:50]), Piece(text[50:], finish_reason="stop")]

    def events() -> list[dict[str, Any]]:
        fmt = ResponseFormatter(parse_chat({**body, "stream": True}), "chatcmpl-9", "m", None, 3, None)
        fmt.created = 1700000000
        return [c for p in pieces for c in fmt.stream_piece(p)]

    first = events()
    assert first == events()
    deltas = [c["choices"][0]["delta"] for c in first]
    whole = ResponseFormatter(parse_chat(body), "chatcmpl-9", "m", None, 3, None)
    whole.created = 1700000000
    message = whole.choice(pieces)["message"]
    assert _joined(deltas) == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert first[-1]["choices"][0]["finish_reason"] == "tool_calls"
