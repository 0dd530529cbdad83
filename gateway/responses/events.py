"""A streamed response's typed events (``event: <type>`` + JSON with ``sequence_number``), from the
chat chunks of the same request (`gateway.output.responses.ResponseFormatter.stream_piece`).

The order is OpenAI's (and vLLM's): ``response.created``, ``response.in_progress``; per output
item ``response.output_item.added``, then its deltas, then its ``.done`` events and
``response.output_item.done``; at the end ``response.completed`` (``response.incomplete`` when
the length limit cut it, ``response.failed`` on an error) with the whole response. Items:
reasoning (``response.reasoning_text.delta``/``.done``), a message (``content_part.added``,
``output_text.delta``/``.done``, ``content_part.done``) and function calls (one item each:
``function_call_arguments.delta``/``.done``). An item is closed when another kind begins, so the
deltas of one item are contiguous and the final object lists the items in the order streamed.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.responses.objects import (
    ResponseShell,
    call_item,
    chat_usage,
    item_id,
    message_item,
    reasoning_item,
    text_part,
)

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def typed_sse(event: dict[str, Any]) -> str:
    """One typed server-sent event."""
    return f"event: {event['type']}\ndata: {_JSON.encode(event)}\n\n"


def chat_chunks(item: str) -> list[dict[str, Any]]:
    """The JSON payloads of the chat SSE events in ``item`` (one write of the chat stream), without ``[DONE]``."""
    out: list[dict[str, Any]] = []
    for block in item.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


class ResponseEvents:
    """Turns one chat stream's chunks into the Responses events, and keeps the final response."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.parts: list[str] = []  # its text or arguments so far (joined once, as it closes)
        self.counts = {"rs": 0, "msg": 0, "fc": 0}
        self.tool_indexes: set[int] = set()
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None  # the response, once ended

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        shown = self.shell.object("in_progress", [])
        return [self._event("response.created", response=shown), self._event("response.in_progress", response=shown)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (an error chunk fails the response)."""
        if "error" in chunk:
            return self.fail(chunk["error"])
        if chunk.get("usage"):
            self.usage = chat_usage(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._text("rs", delta["reasoning"])
            if delta.get("content"):
                events += self._text("msg", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events: the open item's, then ``response.completed`` (or ``.incomplete``)."""
        events = self._close()
        self.final = self.shell.finished(self.output, self.finish_reason, self.usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.final)]

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """``response.failed`` with the error (OpenAI's ``{code, message}``)."""
        events = self._close()
        shown = {"code": error.get("code") or error.get("type") or "server_error", "message": error.get("message", "")}
        self.final = self.shell.object("failed", self.output, self.usage, error=shown)
        return [*events, self._event("response.failed", response=self.final)]

    # -- items ---------------------------------------------------------------------------------
    def _begin(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.counts[kind] += 1
        self.open, self.parts = item, []
        return [*events, self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Reasoning (``rs``) or message text (``msg``): a delta of the open item of that kind."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != ("reasoning" if kind == "rs" else "message"):
            ident = item_id(self.shell.response_id, kind, self.counts[kind])
            if kind == "rs":
                events += self._begin(kind, reasoning_item(ident, "", "in_progress"))
            else:
                events += self._begin(kind, message_item(ident, None, "in_progress"))
                events.append(self._part_event("response.content_part.added", text_part("")))
        assert self.open is not None
        self.parts.append(text)
        where = {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "rs":
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        else:
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return events

    def _part_event(self, kind: str, part: dict[str, Any]) -> dict[str, Any]:
        assert self.open is not None
        return self._event(kind, item_id=self.open["id"], output_index=len(self.output), content_index=0, part=part)

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A streamed tool call's piece: its first (``id``, name) opens a function_call item."""
        events: list[dict[str, Any]] = []
        fn = call.get("function") or {}
        index = call.get("index", len(self.tool_indexes))
        if index not in self.tool_indexes:
            self.tool_indexes.add(index)
            ident = item_id(self.shell.response_id, "fc", self.counts["fc"])
            events += self._begin("fc", call_item(ident, call.get("id", ""), fn.get("name", ""), "", "in_progress"))
        assert self.open is not None
        if fn.get("arguments"):
            self.parts.append(fn["arguments"])
            where = {"item_id": self.open["id"], "output_index": len(self.output)}
            events.append(self._event("response.function_call_arguments.delta", **where, delta=fn["arguments"]))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The ``.done`` events of the open item, which joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        text = "".join(self.parts)
        events: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            events.append(
                self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)
            )
        elif item["type"] == "message":
            done = message_item(item["id"], text)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", **where, part=text_part(text)))
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events
