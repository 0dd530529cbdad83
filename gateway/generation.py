"""One request's journey through the gateway: submit, then engine events -> text pieces.

`Generation` ties together the engine client, the incremental detokenizer and the stop-string
matcher; the HTTP layer only formats its `Piece`s as OpenAI JSON or SSE chunks. Whatever ends the
iteration early (client disconnect, stop string, error) aborts the request in the engine, so its
KV blocks are freed at the next scheduler step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from common.protocol import sampling_to_dict
from common.sampling_params import SamplingParams
from common.transport import TRANSIENT_ERRORS, Outgoing
from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import RequestMetrics
from gateway.openai_schema import ApiError
from gateway.request_handle import EngineUnavailable, RequestHandle
from gateway.router import EngineClient
from gateway.stop import StopMatcher


@dataclass(slots=True)
class Piece:
    """Text to emit now, the tokens it came with, and the finish reason on the last piece.

    ``stop_reason`` (vLLM's, on the last piece): the stop string or the stop token id that ended
    the generation; None when EOS or the length limit did.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    """Drives one submitted request and yields `Piece`s until it finishes."""

    def __init__(self, client: EngineClient, tokenizer: Any, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams, stop: list[str], include_stop: bool, skip_special_tokens: bool,
                 metrics: RequestMetrics | None = None) -> None:
        self.client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = StopMatcher(stop, include_stop)
        self.num_completion_tokens = 0
        self.handle: RequestHandle | None = None
        self.finished = False
        self.metrics = metrics  # observed before each last piece is yielded: a client that has it sees it counted

    async def start(self, journal: list[Outgoing] | None = None) -> None:
        """Submit to the engine (``journal``: a resumable stream's first entries, written first);
        errors here become HTTP errors (nothing was streamed yet)."""
        try:
            self.handle = await self.client.submit(self.request_id, self.prompt_token_ids,
                                                   sampling_to_dict(self.sampling), journal)
        except EngineUnavailable as exc:
            raise ApiError(503, f"engine unavailable: {exc}", "server_error", code="engine_unavailable") from None
        except TRANSIENT_ERRORS as exc:
            raise ApiError(503, f"cannot reach the engine's Redis: {exc}", "server_error") from None

    async def pieces(self) -> AsyncIterator[Piece]:
        assert self.handle is not None, "start() first"
        try:
            while True:
                event = await self.handle.events.get()
                if event.error is not None:
                    self.finished = True
                    if event.finish_reason == "rejected":  # never ran (bad parameters): not a served request
                        raise ApiError(400, event.error, param="max_tokens" if "max_tokens" in event.error else None)
                    self._observe_finish("error")
                    raise ApiError(503, event.error, "server_error", code="engine_error")
                self.num_completion_tokens += len(event.token_ids)
                if self.metrics is not None:
                    self.metrics.on_event(event)
                text = self.detokenizer.add(event.token_ids)
                if event.finished:
                    text += self.detokenizer.finish()
                out, stopped = self.stop.feed(text)
                if stopped:
                    if not event.finished:
                        self.client.abort(self.request_id)  # the engine would go on generating
                    self.finished = True
                    self._observe_finish("stop")
                    yield Piece(out, event.token_ids, event.logprobs, "stop", self.stop.matched)
                    return
                if event.finished:
                    self.finished = True
                    reason = "length" if event.finish_reason == "length" else "stop"
                    self._observe_finish(reason)
                    yield Piece(out + self.stop.flush(), event.token_ids, event.logprobs, reason,
                                event.stop_reason if reason == "stop" else None)
                    return
                if out or event.token_ids:
                    yield Piece(out, event.token_ids, event.logprobs)
        finally:
            if self.finished:
                self.client.release(self.request_id)
            else:  # the consumer went away (client disconnect) or something raised
                self.client.abort(self.request_id)
                self._observe_finish("abort")

    def _observe_finish(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.finish(reason)
