"""The Responses API's objects (OpenAI's and vLLM's shapes): the ``response`` and its output items
(``reasoning``, ``message`` with ``output_text`` parts, ``function_call``), built from a chat
choice's message. Item ids derive from the response id and the item's place, so a streamed
response's events and its final object (and a stored copy) name the same items.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.responses.request import ResponsesRequest


def new_response_id() -> str:
    """A response id: ``resp_`` and 32 hex digits (vLLM's form)."""
    return f"resp_{uuid.uuid4().hex}"


def item_id(response_id: str, prefix: str, index: int) -> str:
    """The id of a response's ``index``-th item of a kind (``rs``, ``msg``, ``fc``)."""
    return f"{prefix}_{hashlib.sha256(f'{response_id}:{prefix}:{index}'.encode()).hexdigest()[:32]}"


def reasoning_item(item: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item, "type": "reasoning", "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"id": item, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def chat_usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat completion's ``usage`` in Responses' form."""
    if not chat:
        return None
    return usage(chat.get("prompt_tokens", 0), chat.get("completion_tokens", 0))


@dataclass(slots=True)
class ResponseShell:
    """What every state of one response shows: its id, time, model and the request's echoed fields."""

    response_id: str
    created_at: int
    model: str
    request: ResponsesRequest

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object in ``status`` (queued, in_progress, completed, incomplete, failed, cancelled)."""
        req = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": req.background,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": req.instructions,
            "max_output_tokens": req.body.get("max_output_tokens"),
            "max_tool_calls": req.body.get("max_tool_calls"),
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.body.get("parallel_tool_calls", True),
            "previous_response_id": req.previous_response_id,
            "reasoning": req.body.get("reasoning"),
            "store": req.store,
            "temperature": req.body.get("temperature"),
            "text": {"format": req.text_format},
            "tool_choice": req.tool_choice,
            "tools": req.tools,
            "top_p": req.body.get("top_p"),
            "truncation": req.body.get("truncation") or "disabled",
            "usage": usage,
            "user": req.body.get("user"),
        }

    def finished(self, output: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response once its generation ended: "incomplete" when the length limit cut it."""
        if finish_reason == "length":
            return self.object("incomplete", output, usage, incomplete_reason="max_output_tokens")
        return self.object("completed", output, usage)

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The finished response of a (non-streaming) chat completion."""
        choice = chat["choices"][0]
        return self.finished(self.output_items(choice["message"]), choice.get("finish_reason"), chat_usage(chat.get("usage")))

    def output_items(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat message's reasoning, text and tool calls as output items, in that order."""
        rid = self.response_id
        items: list[dict[str, Any]] = []
        if message.get("reasoning"):
            items.append(reasoning_item(item_id(rid, "rs", 0), message["reasoning"]))
        if message.get("content"):
            items.append(message_item(item_id(rid, "msg", 0), message["content"]))
        for i, call in enumerate(message.get("tool_calls") or []):
            fn = call["function"]
            items.append(call_item(item_id(rid, "fc", i), call["id"], fn["name"], fn["arguments"]))
        return items


def history_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up turn continues after: the text
    and the calls in one assistant message (reasoning is not fed back)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
