"""A ``POST /v1/responses`` body as a chat completion request: the Responses API runs over the chat
path (its template, sampling, structured outputs and output parsers), so this module only maps
Responses' shapes onto chat's, and `gateway.openai.schema.parse_chat` validates the result.

- ``instructions`` -> a system message first (never carried into a later turn, as OpenAI's);
- ``input``: a string (one user message) or items: messages (``input_text``/``output_text``
  parts), ``function_call`` items (-> an assistant message's ``tool_calls``, consecutive calls in
  one message) and ``function_call_output`` items (-> ``tool`` messages); ``reasoning`` items are
  not fed back (the chat templates drop earlier turns' thinking too);
- ``max_output_tokens`` -> ``max_tokens``; ``text.format`` -> ``response_format``; the flat
  function tools ``{"type": "function", "name", "parameters"}`` -> chat's nested ones, and a
  named ``tool_choice`` likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.http.errors import bad
from gateway.openai.json_input import get_bool, get_field, preview, typename

# Fields passed through to chat as they are (OpenAI's and vLLM's sampling extras).
PASSED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "priority",
    "cache_salt",
    "structured_outputs",
)
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# The most input items one request may carry (parsing runs on the event loop).
MAX_INPUT_ITEMS = 4096


@dataclass(slots=True)
class ResponsesRequest:
    """A validated Responses request: its chat fields and what the response object echoes."""

    body: dict[str, Any]  # the client's body, as sent
    messages: list[dict[str, Any]]  # this turn's input as chat messages (without the instructions)
    chat: dict[str, Any]  # the chat request's fields other than ``messages``
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # as sent (the flat shape)
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    metadata: dict[str, Any] | None = None

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion body of this turn after ``history`` (an earlier turn's messages)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {**self.chat, "messages": [*system, *history, *self.messages]}


def parse_responses(body: Any) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body (400s name the field at fault)."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {typename(body)}")
    for name in ("prompt", "conversation"):
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported by this server", name)
    instructions = get_field(body, "instructions", lambda v: isinstance(v, str), "a string", None)
    stream = get_bool(body, "stream", False)
    store = get_bool(body, "store", True)
    background = get_bool(body, "background", False)
    if background and not store:
        raise bad("'background' requires 'store' to be true", "background")
    previous = get_field(body, "previous_response_id", lambda v: isinstance(v, str) and v != "", "a response id", None)
    metadata = get_field(body, "metadata", lambda v: isinstance(v, dict), "an object", None)
    tools = get_field(body, "tools", lambda v: isinstance(v, list), "an array", [])
    tool_choice = body.get("tool_choice", "auto" if tools else None)
    chat: dict[str, Any] = {k: body[k] for k in PASSED_FIELDS if k in body}
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        chat["max_tokens"] = max_output
    if tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(tools)]
    if tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(tool_choice)
    text = get_field(body, "text", lambda v: isinstance(v, dict), "an object", {})
    text_format = get_field(text, "format", lambda v: isinstance(v, dict), "an object", {"type": "text"})
    response_format = _response_format(text_format)
    if response_format is not None:
        chat["response_format"] = response_format
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return ResponsesRequest(
        body=body,
        messages=input_messages(body.get("input")),
        chat=chat,
        instructions=instructions,
        stream=stream,
        store=store,
        background=background,
        previous_response_id=previous,
        tools=tools,
        tool_choice=tool_choice if tool_choice is not None else "auto",
        text_format=text_format,
        metadata=metadata,
    )


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string or an array of items) as chat messages; a 400 for an item it cannot map."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("'input' must be a string or a non-empty array of input items", "input")
    if len(value) > MAX_INPUT_ITEMS:
        raise bad(f"'input' may hold at most {MAX_INPUT_ITEMS} items, got {len(value)}", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object, got {typename(item)}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {preview(role)}", "input")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise bad(
                f"{where}.type {preview(kind)} is not supported (message, function_call, function_call_output, reasoning)",
                "input",
            )
    if not out:
        raise bad("'input' holds no message", "input")
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key} must be a string, got {typename(value)}", "input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content parts, got {typename(content)}", "input")
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
            raise bad(f"{where}[{j}] must be a text part (input_text or output_text), got {preview(kind)}", "input")
        texts.append(part["text"])  # type: ignore[index]
    return "".join(texts)


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else typename(tool)
        raise bad(f"tools[{i}] must be a function tool; {preview(kind)} tools are not supported", "tools")
    if "function" in tool:  # chat's nested shape, which some clients send here too
        return tool
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    """``tool_choice``: "auto", "none", "required", or a named function (flat) in chat's shape."""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # (chat's parser names what is wrong with anything else)


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: free text)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad("'text.format.schema' must be a JSON schema object", "text.format")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}
    raise bad(f"'text.format.type' must be text, json_object or json_schema, got {preview(kind)}", "text.format")
