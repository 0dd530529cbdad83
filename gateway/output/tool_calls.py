"""OpenAI ``tool_calls`` from the text a tool-constrained chat request generated (free-form
output under ``tool_choice`` "auto" goes through `gateway.output.tool_parsers` instead).

Under ``tool_choice`` "required" the text is a JSON array ``[{"name", "parameters"}, ...]``, under
a named function it is that function's arguments (`gateway.openai.structured`). A call's arguments
are the text of its ``parameters`` as generated (compact JSON: the grammar allows no free
whitespace). Streamed, the calls go out in pieces as they are generated (`ConstrainedCallStream`,
`gateway.output.call_deltas`): the name and id once known, then the arguments. Call ids derive from
the response id, its creation time and the choice index, all journaled, so a resumed stream replays
the same ones, while every choice and every response (a client may reuse its ``X-Request-Id`` once
the last stream under it is over) gets its own: clients match tool results to calls by id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gateway.openai.structured import ToolCallMode
from gateway.output.call_deltas import CallPiece, CallScanner, join_pieces
from gateway.output.tool_parsers import Call, arguments_json


def tool_calls(mode: ToolCallMode, text: str, response_id: str, created: int, choice: int) -> list[dict[str, Any]] | None:
    """The calls ``text`` makes, in OpenAI's message form; None when it is not complete (a request
    cut short by ``max_tokens``): its text is then returned as content."""
    calls = _calls(mode, text)
    return None if calls is None else with_ids(calls, response_id, created, choice, mode.id_length)


def _calls(mode: ToolCallMode, text: str) -> list[Call] | None:
    try:  # nested past the interpreter's recursion limit (a grammar can force that): no calls either
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if mode.kind == "named":
        assert mode.name is not None
        return [(mode.name, text)]
    if not isinstance(value, list) or not value:
        return None
    for call in value:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        if arguments_json(call.get("parameters", {})) is None:  # (a lone surrogate, which no UTF-8 response holds)
            return None
    scanner = CallScanner()
    calls = join_pieces([*scanner.feed(text), *scanner.finish()])
    return calls if len(calls) == len(value) else None


def with_ids(calls: list[Call], response_id: str, created: int, choice: int, id_length: int = 0) -> list[dict[str, Any]]:
    """``calls`` (name, arguments) in OpenAI's message form, each with its id: ``chatcmpl-tool-``
    and 24 hex digits, or ``id_length`` hex digits alone (a model whose template checks them)."""
    return [
        {
            "id": call_id(response_id, created, choice, i, id_length),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for i, (name, arguments) in enumerate(calls)
    ]


def call_id(response_id: str, created: int, choice: int, index: int, id_length: int = 0) -> str:
    """The id of call ``index`` of a choice (`with_ids`)."""
    digest = hashlib.sha256(f"{response_id}:{created}:{choice}:{index}".encode()).hexdigest()
    return digest[:id_length] if id_length else "chatcmpl-tool-" + digest[:24]


def delta_entries(pieces: list[CallPiece], ids: tuple[str, int, int], id_length: int = 0) -> list[dict[str, Any]]:
    """Call ``pieces`` as the entries of a streamed ``delta.tool_calls``: one per call, with its
    ``index``; a call's first (its name known) with its id, type and name too. ``ids``: what the
    call ids derive from (`with_ids`)."""
    out = []
    for index, name, arguments in _merged(pieces):
        if name is None:
            out.append({"index": index, "function": {"arguments": arguments}})
        else:
            out.append(
                {
                    "index": index,
                    "id": call_id(*ids, index, id_length),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
    return out


def _merged(pieces: list[CallPiece]) -> list[CallPiece]:
    """``pieces`` with a call's consecutive ones joined: one entry per call and delta."""
    out: list[CallPiece] = []
    for index, name, arguments in pieces:
        if out and out[-1][0] == index:
            out[-1] = (index, out[-1][1] if out[-1][1] is not None else name, out[-1][2] + arguments)
        else:
            out.append((index, name, arguments))
    return out


class ConstrainedCallStream:
    """A streamed choice's calls under "required" or a named function, in pieces as generated.
    The finish reason is "tool_calls" when the output stopped with whole calls; an output cut
    short (``max_tokens``) keeps its reason, after the pieces already sent (as vLLM streams it),
    or comes as content if it had not reached a call's name."""

    def __init__(self, mode: ToolCallMode) -> None:
        self.mode = mode
        self.text: list[str] = []
        self.required = CallScanner() if mode.kind == "required" else None
        self.started = False  # a named call's first piece (name and id) sent

    def delta(self, text: str, finish_reason: str | None, ids: tuple[str, int, int]) -> tuple[dict[str, Any], str | None]:
        """The delta of one piece's ``text`` (empty while nothing is known) and its finish reason."""
        self.text.append(text)
        pieces: list[CallPiece]
        if self.required is not None:
            pieces = self.required.feed(text)
            if finish_reason is not None:
                pieces += self.required.finish()
        elif text or (finish_reason is not None and not self.started):
            pieces = [(0, None if self.started else self.mode.name, text)]
            self.started = True
        else:
            pieces = []
        delta: dict[str, Any] = {}
        if pieces:
            delta["tool_calls"] = delta_entries(pieces, ids, self.mode.id_length)
        if finish_reason is None:
            return delta, None
        whole = "".join(self.text)
        if finish_reason == "stop" and _calls(self.mode, whole) is not None:
            return delta, "tool_calls"
        if self.required is not None and not any(c.name_sent for c in self.required.calls):
            return {"content": whole}, finish_reason
        return delta, finish_reason
