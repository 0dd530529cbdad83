"""OpenAI response bodies and SSE chunks for completions and chat completions.

A chat request whose ``tool_choice`` constrains it to tool calls (`gateway.openai.structured`) answers
with ``tool_calls`` and finish reason "tool_calls"; streamed, the calls go out in pieces as they
are generated (`gateway.output.tool_calls`). Free-form output goes through the gateway's
parsers, of a thinking model's reasoning and of "auto" tool calls (`gateway.output.chat_output`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from gateway.openai.schema import GenerationSpec
from gateway.openai.structured import ToolCallMode
from gateway.output.chat_output import ChatOutput
from gateway.output.generation import Piece
from gateway.output.prompt_logprobs import vllm_prompt_logprobs
from gateway.output.reasoning_parsers import REASONING_PARSERS
from gateway.output.tool_calls import ConstrainedCallStream, tool_calls
from gateway.output.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("conveyor.gateway")


class ResponseFormatter:
    """Formats one choice's pieces (choice ``index``); keeps the running text offset for completion
    logprobs. With ``echo`` and logprobs, a completion's logprobs start with the prompt's (from the
    piece that carries them; the first token's is null): ``prompt_token_ids`` names its tokens.
    Streamed, the echo chunk then waits for the first piece, which brings the prompt's logprobs,
    and carries them (vLLM streams them with the echo too); without logprobs it is sent at once."""

    def __init__(
        self,
        spec: GenerationSpec,
        request_id: str,
        model: str,
        tokenizer: Any,
        num_prompt_tokens: int,
        echo_text: str | None,
        index: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.spec = spec
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.echo_text = echo_text
        self.created = int(time.time())
        self.text_offset = len(echo_text) if echo_text else 0
        self.chat = spec.kind == "chat"
        self.tool_call: ToolCallMode | None = spec.structured.tool_call if spec.structured is not None else None
        # streaming: a tool-constrained request's calls, in pieces
        self.call_stream = (
            ConstrainedCallStream(self.tool_call) if self.tool_call is not None and self.tool_call.kind != "parsed" else None
        )
        tools = self.tool_call.parser if self.tool_call is not None else None  # "auto" tool calls
        self.output = (
            ChatOutput(
                REASONING_PARSERS[spec.reasoning_parser] if spec.reasoning_parser else None,
                spec.include_reasoning,
                TOOL_CALL_PARSERS[tools] if tools else None,
                self.tool_call is not None and self.tool_call.single,
                spec.reasoning_phase,
                {t["function"]["name"]: t["function"].get("parameters") or {} for t in spec.structured.tools}
                if spec.structured is not None
                else None,
                self.tool_call.id_length if self.tool_call is not None else 0,
            )
            if self.chat and (tools or spec.reasoning_parser)
            else None
        )
        self.completion_tokens = 0  # streaming: the choice's tokens so far (``continuous_usage``)
        self.prompt_ids_pending = spec.return_token_ids  # streaming: the first chunk carries them
        # streaming: the echo chunk waits for the prompt's logprobs (on the first piece)
        self.echo_pending = bool(echo_text) and not self.chat and spec.logprobs is not None

    # -- pieces ------------------------------------------------------------------------------
    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.num_prompt_tokens + completion_tokens,
        }

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_name(self, token_id: int) -> str:
        """How logprobs name a token: its text, or ``token_id:<id>`` (``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if self.spec.return_tokens_as_token_ids else self._token_text(token_id)

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        n = self.spec.logprobs or 0
        return sorted(entry.items(), key=lambda kv: -kv[1])[:n]

    def _top_with(self, entry: dict[int, float], token_id: int) -> dict[str, float]:
        """Completions' ``top_logprobs`` of one position: the top ``logprobs`` and the token chosen
        there, whether or not it is among them (OpenAI's and vLLM's rule: up to ``logprobs`` + 1)."""
        top = self._top(entry)
        if token_id in entry and all(t != token_id for t, _ in top):
            top.append((token_id, entry[token_id]))
        return {self._token_name(t): v for t, v in top}

    def logprobs(self, pieces: list[Piece], with_prompt: bool = True) -> dict[str, Any] | None:
        """Logprobs of the tokens in ``pieces``, in completions or chat format; an echoed
        completion's start with the prompt's (unless not ``with_prompt``)."""
        if self.spec.logprobs is None:
            return None
        pairs = [(t, lp) for p in pieces for t, lp in zip(p.token_ids, p.logprobs)]
        if self.chat:
            content = []
            for token_id, entry in pairs:
                text = self._token_name(token_id)
                content.append(
                    {
                        "token": text,
                        "logprob": (entry or {}).get(token_id, 0.0),
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": (s := self._token_name(t)), "logprob": v, "bytes": list(s.encode())}
                            for t, v in self._top(entry or {})
                        ],
                    }
                )
            return {"content": content}
        prompt_lps = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None)
        out = self._prompt_logprobs(prompt_lps if with_prompt else None)
        for token_id, entry in pairs:
            text = self._token_text(token_id)  # (offsets index the text whatever names the tokens)
            out["tokens"].append(self._token_name(token_id))
            out["token_logprobs"].append((entry or {}).get(token_id))
            out["top_logprobs"].append(self._top_with(entry or {}, token_id))
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out

    def _prompt_logprobs(self, prompt_lps: list[dict[int, float] | None] | None) -> dict[str, list[Any]]:
        """Completions-format logprobs of the echoed prompt (empty lists without them). Offsets
        count the tokens' strings, as vLLM's do, and the completion's go on from the prompt's: the
        echoed text has no special tokens (a BOS), so counting it instead made them go backwards."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt_lps is None or self.echo_text is None or self.prompt_token_ids is None:
            return out
        offset = 0
        for token_id, prompt_entry in zip(self.prompt_token_ids, prompt_lps):
            text = self._token_text(token_id)
            out["tokens"].append(self._token_name(token_id))
            out["token_logprobs"].append(None if prompt_entry is None else prompt_entry.get(token_id))
            out["top_logprobs"].append(None if prompt_entry is None else self._top_with(prompt_entry, token_id))
            out["text_offset"].append(offset)
            offset += len(text)
        self.text_offset = offset
        return out

    # -- non-streaming -----------------------------------------------------------------------
    def full_response(self, pieces: list[Piece], completion_tokens: int) -> dict[str, Any]:
        return self.response([self.choice(pieces)], completion_tokens)

    def response(self, choices: list[dict[str, Any]], completion_tokens: int) -> dict[str, Any]:
        """The whole response body around ``choices`` (a chat's prompt token ids on it, with
        ``return_token_ids``; a completion's are on each choice: each may have its own prompt)."""
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(completion_tokens),
        }
        if self.chat and self.spec.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        if self.chat and self.spec.prompt_logprobs is not None:  # vLLM's: one prompt, on the response
            body["prompt_logprobs"] = next((c.pop("prompt_logprobs") for c in choices if "prompt_logprobs" in c), None)
            for c in choices:
                c.pop("prompt_logprobs", None)
        return body

    def _with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        """``choice`` with vLLM's ``return_token_ids``: its tokens, and a completion's prompt tokens
        (on its first streamed chunk)."""
        if self.spec.return_token_ids:
            choice["token_ids"] = token_ids
            if not self.chat and self.prompt_ids_pending:
                choice["prompt_token_ids"] = self.prompt_token_ids
                self.prompt_ids_pending = False
        return choice

    def choice(self, pieces: list[Piece]) -> dict[str, Any]:
        """This choice of a non-streaming response, from all its pieces."""
        text = "".join(p.text for p in pieces)
        reason = pieces[-1].finish_reason if pieces else "stop"
        stop_reason = pieces[-1].stop_reason if pieces else None
        logprobs = self.logprobs(pieces)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.output is not None:
                message, reason = self.output.message(text, reason, self._call_ids())
            elif self.tool_call and reason == "stop" and (calls := self._constrained_calls(text)):
                message, reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            if self.echo_text:  # vLLM's: the answer goes on from the last (assistant) message
                message["content"] = self.echo_text + (message["content"] or "")
            out = {
                "index": self.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
        else:
            out = {
                "index": self.index,
                "text": (self.echo_text or "") + text,
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": stop_reason,
            }
        if (k := self.spec.prompt_logprobs) is not None and self.prompt_token_ids is not None:
            entries = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None)
            if entries is not None:  # (on a chat's response, not its choice: `response`)
                out["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_token_ids, entries, k, self._token_text)
        return self._with_token_ids(out, [t for p in pieces for t in p.token_ids])

    # -- streaming ---------------------------------------------------------------------------
    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.spec.include_usage:
            chunk["usage"] = self.usage(self.completion_tokens) if self.spec.continuous_usage else None
        return chunk

    def stream_start(self) -> list[dict[str, Any]]:
        if self.chat:
            chunk = self._chunk(
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            )
            if self.prompt_ids_pending:  # (a chat's on the chunk, as on its response)
                chunk["prompt_token_ids"], self.prompt_ids_pending = self.prompt_token_ids, False
            if not self.echo_text:
                return [chunk]
            echo = {"index": self.index, "delta": {"content": self.echo_text}, "logprobs": None, "finish_reason": None}
            return [chunk, self._chunk({**echo, "stop_reason": None})]
        if self.echo_text and not self.echo_pending:
            return [self._echo_chunk(None)]
        return []

    def _echo_chunk(self, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice = {"index": self.index, "text": self.echo_text, "logprobs": logprobs, "finish_reason": None, "stop_reason": None}
        return self._chunk(self._with_token_ids(choice, []))

    def stream_piece(self, piece: Piece) -> list[dict[str, Any]]:
        """The chunks of one piece: after the echo chunk, if it waited for this (the first) piece."""
        chunks: list[dict[str, Any]] = []
        if self.echo_pending:  # (before this piece's tokens: the echo's usage counts none of them)
            self.echo_pending = False
            chunks.append(self._echo_chunk(self._prompt_logprobs(piece.prompt_logprobs)))
        self.completion_tokens = piece.completion_tokens
        logprobs = self.logprobs([piece], with_prompt=False)
        # (with return_token_ids a piece's tokens always go out, text or not: a client counts on them)
        wants_ids = self.spec.return_token_ids and bool(piece.token_ids)
        if piece.text or (logprobs is not None and piece.token_ids) or piece.finish_reason is not None or wants_ids:
            if self.chat:
                delta: dict[str, Any] = {"content": piece.text} if piece.text or piece.finish_reason is None else {}
                reason = piece.finish_reason
                if self.output is not None:
                    delta, reason = self.output.delta(piece.text, piece.finish_reason, self._call_ids())
                elif self.call_stream is not None:
                    delta, reason = self.call_stream.delta(piece.text, piece.finish_reason, self._call_ids())
                choice = {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": piece.stop_reason,
                }
                if not delta and reason is None and logprobs is None and not wants_ids:
                    choice = {}  # a tool call's text, held back until its name is known
            else:
                choice = {
                    "index": self.index,
                    "text": piece.text,
                    "logprobs": logprobs,
                    "finish_reason": piece.finish_reason,
                    "stop_reason": piece.stop_reason,
                }
            if choice:
                chunks.append(self._chunk(self._with_token_ids(choice, list(piece.token_ids))))
        return chunks

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        return {**self._chunk({}), "choices": [], "usage": self.usage(completion_tokens)}

    def _call_ids(self) -> tuple[str, int, int]:
        """What this choice's tool call ids derive from (`gateway.output.tool_calls.with_ids`)."""
        return self.request_id, self.created, self.index

    def _constrained_calls(self, text: str) -> list[dict[str, Any]] | None:
        assert self.tool_call is not None
        return tool_calls(self.tool_call, text, *self._call_ids())


# Built once: `json.dumps` with any non-default argument builds a new encoder per call, most of an
# SSE event's formatting cost (one event per request per step).
_SSE_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def sse(payload: dict[str, Any], number: int | str) -> str:
    """One server-sent event numbered ``number`` (its ``id:``, for ``Last-Event-ID``)."""
    return f"id: {number}\ndata: {_SSE_JSON.encode(payload)}\n\n"


DONE_DATA = b"data: [DONE]\n\n"


def done_event(number: int | str) -> str:
    """The stream's last event, ``[DONE]``, numbered ``number``."""
    return f"id: {number}\n{DONE_DATA.decode()}"


class EventStreamResponse(StreamingResponse):
    """An SSE body, one write per item of its iterator (the streams yield the events that are ready
    together as one item). The item that ends with ``[DONE]`` also ends the body, so the last
    events, ``[DONE]`` and the body's end take one write (and one wakeup of the client) instead of
    four (docs/performance.md)."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for item in self.body_iterator:
            if ended:  # nothing follows [DONE]; the iterator is drained so that it can clean up
                continue
            data = item if isinstance(item, bytes) else bytes(item) if isinstance(item, memoryview) else item.encode()
            ended = data.endswith(DONE_DATA)
            await send({"type": "http.response.body", "body": data, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
