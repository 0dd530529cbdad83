"""OpenAI ``tool_calls`` from the text a tool-constrained chat request generated (free-form
output under ``tool_choice`` "auto" goes through `gateway.output.tool_parsers` instead).

Under ``tool_choice`` "required" the text is a JSON array ``[{"name", "parameters"}, ...]``, under
a named function it is that function's arguments (`gateway.openai.structured`). Streaming sends the calls
whole in the final chunk (``delta.tool_calls``, finish reason "tool_calls"): the arguments are only
known to be complete JSON at the end, and incremental argument deltas would need a JSON parser
running over every token. Call ids derive from the response id, its creation time and the choice
index, all journaled, so a resumed stream replays the same ones, while every choice and every
response (a client may reuse its ``X-Request-Id`` once the last stream under it is over) gets its
own: clients match tool results to calls by id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gateway.openai.structured import ToolCallMode
from gateway.output.tool_parsers import Call, arguments_json


def tool_calls(mode: ToolCallMode, text: str, response_id: str, created: int, choice: int) -> list[dict[str, Any]] | None:
    """The calls ``text`` makes, in OpenAI's message form; None when it is not complete (a request
    cut short by ``max_tokens``): its text is then returned as content."""
    calls: list[Call] = []
    try:  # nested past the interpreter's recursion limit (a grammar can force that): no calls either
        value = json.loads(text)
        if mode.kind == "named":
            assert mode.name is not None
            calls.append((mode.name, text))
        else:
            if not isinstance(value, list) or not value:
                return None
            for call in value:
                if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                    return None
                parameters = arguments_json(call.get("parameters", {}))
                if parameters is None:  # (a lone surrogate, which no UTF-8 response holds: the text, as is)
                    return None
                calls.append((call["name"], parameters))
    except (ValueError, RecursionError):
        return None
    return with_ids(calls, response_id, created, choice, mode.id_length)


def with_ids(calls: list[Call], response_id: str, created: int, choice: int, id_length: int = 0) -> list[dict[str, Any]]:
    """``calls`` (name, arguments) in OpenAI's message form, each with its id: ``chatcmpl-tool-``
    and 24 hex digits, or ``id_length`` hex digits alone (a model whose template checks them)."""
    return [
        {
            "id": _call_id(hashlib.sha256(f"{response_id}:{created}:{choice}:{i}".encode()).hexdigest(), id_length),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for i, (name, arguments) in enumerate(calls)
    ]


def _call_id(digest: str, id_length: int) -> str:
    return digest[:id_length] if id_length else "chatcmpl-tool-" + digest[:24]


def stream_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` as the entries of a streamed ``delta.tool_calls`` (each with its ``index``)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]
