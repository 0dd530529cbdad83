"""A chat choice's free-form output as message fields: reasoning, content and "auto" tool calls.

A reasoning parser (`gateway.output.reasoning_parsers`) takes the model's thinking out of the text, into
``reasoning`` (vLLM's current name) and ``reasoning_content`` (vLLM's earlier one, DeepSeek's API's),
dropped with vLLM's ``include_reasoning: false``; a tool-call parser (`gateway.output.tool_parsers`) then
finds the calls in what is left, the content. Streamed, both run incrementally (calls in pieces)
and the deltas join to the response of the same tokens.
"""

from __future__ import annotations

from typing import Any

from gateway.output.call_deltas import CallPiece
from gateway.output.reasoning_parsers import ReasoningStream, ThinkParser
from gateway.output.tool_calls import delta_entries, with_ids
from gateway.output.tool_parsers import Call, CallStream, Schemas, ToolCallParser, split_calls


class ChatOutput:
    """One chat choice's text through its parsers (``reasoning``, ``tools``; at least one).
    ``ids`` (of `message` and `delta`): the response id, creation time and choice index its
    calls' ids derive from (a resumed stream's creation time is set after it is built)."""

    def __init__(
        self,
        reasoning: ThinkParser | None,
        include_reasoning: bool,
        tools: ToolCallParser | None,
        one_call: bool = False,
        phase: str = "",
        schemas: Schemas | None = None,
        id_length: int = 0,
    ) -> None:
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self.tools = tools
        self.one_call = one_call  # ``parallel_tool_calls: false``: the first call only (vLLM's rule)
        self.phase = phase  # where the prompt left the output (`gateway.output.reasoning_parsers.prompt_phase`)
        self.schemas = schemas  # the tools' parameter schemas (a parser whose values are text types them)
        self.id_length = id_length  # of call ids (`gateway.output.tool_calls.with_ids`)
        self.reasoning_stream = ReasoningStream(reasoning, phase) if reasoning is not None else None
        self.call_stream = CallStream(tools, schemas) if tools is not None else None

    def _with_ids(self, calls: list[Call], ids: tuple[str, int, int]) -> list[dict[str, Any]]:
        return with_ids(calls, *ids, id_length=self.id_length)

    def _with_reasoning(self, fields: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
        if reasoning and self.include_reasoning:
            fields["reasoning"] = fields["reasoning_content"] = reasoning
        return fields

    def message(self, text: str, finish_reason: str | None, ids: tuple[str, int, int]) -> tuple[dict[str, Any], str | None]:
        """The non-streaming message of the whole ``text`` and its finish reason ("tool_calls" with calls)."""
        reasoning, content = self.reasoning.split(text, self.phase) if self.reasoning is not None else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content or None if self.reasoning else content}
        if self.tools is not None:
            before, calls = split_calls(self.tools, content, finish_reason == "stop", self.schemas)
            if calls:
                calls = calls[:1] if self.one_call else calls
                message = {"role": "assistant", "content": before or None, "tool_calls": self._with_ids(calls, ids)}
                finish_reason = "tool_calls"
        return self._with_reasoning(message, reasoning), finish_reason

    def delta(self, text: str, finish_reason: str | None, ids: tuple[str, int, int]) -> tuple[dict[str, Any], str | None]:
        """A streamed piece's delta (empty while text is held) and its finish reason; the last
        piece's (``finish_reason`` set) carries what was held and the calls."""
        reasoning, content = self.reasoning_stream.feed(text) if self.reasoning_stream is not None else ("", text)
        if finish_reason is not None and self.reasoning_stream is not None:
            more_reasoning, more_content = self.reasoning_stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        pieces: list[CallPiece] = []
        if self.call_stream is not None:
            content = self.call_stream.feed(content)
            pieces = self.call_stream.pieces()
            if finish_reason is not None:
                rest, calls = self.call_stream.finish(finish_reason == "stop")
                content += rest
                if calls:
                    pieces += self.call_stream.last_pieces(calls[:1] if self.one_call else calls)
                    finish_reason = "tool_calls"
        if self.one_call:
            pieces = [p for p in pieces if p[0] == 0]
        delta = self._with_reasoning({}, reasoning)
        if content:
            delta["content"] = content
        if pieces:
            delta["tool_calls"] = delta_entries(pieces, ids, self.id_length)
        return delta, finish_reason
