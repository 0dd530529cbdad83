"""One request's journey through the gateway: submit, then engine events -> text pieces.

`Generation` ties together the engine client and the request's output processing
(`gateway.output.processor`: detokenization, stop strings); the HTTP layer only formats its
`Piece`s as OpenAI JSON or SSE chunks. Whatever ends the iteration early (client disconnect,
stop string, error) aborts the request in the engine, so its KV blocks are freed at the next
scheduler step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from common.logs import log_event
from common.protocol import TAKEN_OVER
from common.redis_errors import REDIS_FAILURES
from common.sampling_params import SamplingParams, sampling_to_dict
from common.transport import Outgoing
from gateway.engine.client import EngineClient
from gateway.engine.handle import EngineUnavailable, RequestHandle, RequestIdInUse
from gateway.http.errors import ApiError
from gateway.http.metrics import RequestMetrics
from gateway.output.processor import OutputProcessor

# One line per finished request (`RequestLog`), under a logger of its own: easy to route or mute.
request_logger = logging.getLogger("conveyor.gateway.requests")
logger = logging.getLogger("conveyor.gateway")


@dataclass(slots=True)
class Piece:
    """Text to emit now, the tokens it came with, and the finish reason on the last piece.

    ``stop_reason`` (vLLM's, on the last piece): the stop string or the stop token id that ended
    the generation; None when EOS or the length limit did. ``prompt_logprobs`` (on the piece of the
    engine's first output, when the request asked for them): one entry per prompt token, None first.
    ``completion_tokens``: the request's tokens up to this piece's last (a consumer may format it
    after later pieces arrived: the count must be the piece's own).
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    completion_tokens: int = 0


@dataclass(slots=True)
class RequestLog:
    """What a request's log line says besides its tokens and its engine: `Generation` logs it once,
    as the request ends (`log_event`: ``request finished: request_id=... model=...``, or as JSON).

    Times are this gateway's: from ``arrival`` (`time.monotonic()` when it got the request; None
    for a stream resumed here, whose times began on another gateway) to the first token (TTFT) and
    to the end.
    """

    response_id: str
    model: str
    kind: str  # "completion" | "chat"
    stream: bool
    arrival: float | None
    first_token_at: float | None = None
    logged: bool = False

    def emit(
        self, handle: RequestHandle | None, gateway_id: str, prompt_tokens: int, completion_tokens: int, finish_reason: str
    ) -> None:
        """Log the finished request once (``finish_reason``: stop, length, abort, error or rejected)."""
        if self.logged:
            return
        self.logged = True
        now = time.monotonic()
        arrival, first = self.arrival, self.first_token_at
        log_event(
            request_logger,
            logging.INFO,
            "request finished",
            {
                "request_id": self.response_id,
                "model": self.model,
                "kind": self.kind,
                "stream": self.stream,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "ttft_s": first - arrival if arrival is not None and first is not None else None,
                "total_s": now - arrival if arrival is not None else None,
                "finish_reason": finish_reason,
                "engine": handle.scheduler_id if handle is not None else None,
                "engine_request_id": handle.engine_request_id if handle is not None else None,
                "migrations": max(handle.attempts - 1, 0) if handle is not None else 0,
                "gateway": gateway_id,
                "resumed": arrival is None,
            },
        )


@dataclass(slots=True)
class SequenceRequest:
    """What one sequence of a response (a choice, or a ``best_of`` candidate) asks of the engine:
    `GenerateRequest`'s fields that the gateway chooses. ``request_id`` is unique
    (`RequestHandle.request_id`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    cache_salt: str = ""


class Generation:
    """Drives one submitted request and yields `Piece`s until it finishes."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        request: SequenceRequest,
        metrics: RequestMetrics | None = None,
        log: RequestLog | None = None,
    ) -> None:
        self.client = client
        self.request = request
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.output = OutputProcessor(tokenizer, request.sampling)
        self.num_completion_tokens = 0
        self.handle: RequestHandle | None = None
        self.finished = False
        self.got_prompt_logprobs = False
        self.metrics = metrics  # observed before each last piece is yielded: a client that has it sees it counted
        self.log = log  # likewise logged

    async def start(
        self,
        journal_id: str = "",
        journal: list[Outgoing] | None = None,
        claim: Outgoing | None = None,
        group_id: str = "",
        prefer_engine: str = "",
    ) -> None:
        """Submit to the engine (a resumable stream, siblings: see `EngineClient.submit`); errors
        here become HTTP errors (nothing was streamed yet)."""
        # The client's id: a journal's name is scoped by tenant (`gateway.http.tenants`).
        shown = self.log.response_id if self.log is not None else journal_id or self.request_id
        try:
            self.handle = await self.client.submit(
                self.request_id,
                self.prompt_token_ids,
                sampling_to_dict(self.request.sampling),
                journal_id,
                journal,
                claim,
                group_id,
                prefer_engine,
                self.request.priority,
                self.request.cache_salt,
            )
        except RequestIdInUse:
            raise ApiError(
                409,
                f"request id {shown!r} (X-Request-Id, or the request_id field) names a stream in flight or "
                f"still resumable (GET /v1/streams/{shown} resumes it); send another id",
                param="X-Request-Id",
                code="duplicate_request_id",
            ) from None
        except EngineUnavailable as exc:
            raise ApiError(503, f"engine unavailable: {exc}", "server_error", code="engine_unavailable") from None
        except REDIS_FAILURES as exc:  # out of reach, or refusing writes (out of memory, read-only)
            logger.warning("request %s: Redis failed: %s", shown, exc)
            raise ApiError(503, f"the engine's Redis failed ({type(exc).__name__}); retry shortly", "server_error") from None

    async def pieces(self) -> AsyncIterator[Piece]:
        assert self.handle is not None, "start() first"
        try:
            while True:
                event = await self.handle.events.get()
                if event.error is not None:
                    self.finished = True
                    if event.finish_reason == "rejected":  # never ran (bad parameters): not a served request
                        self._finish("rejected")
                        raise ApiError(400, event.error, param="max_tokens" if "max_tokens" in event.error else None)
                    # Taken over: the stream goes on (and is counted) on the gateway that resumed it.
                    self._finish("abort" if event.finish_reason == TAKEN_OVER else "error")
                    raise ApiError(503, event.error, "server_error", code="engine_error")
                if self.log is not None and self.log.first_token_at is None and event.token_ids and not event.replayed:
                    self.log.first_token_at = time.monotonic()
                delta = self.output.add(event.token_ids, event.finished, event.finish_reason, event.stop_reason)
                used = delta.num_tokens
                if used < len(event.token_ids):  # a stop string ended it: the tokens after are not the client's
                    # (nor the engine steps they came from: one token a step, as the metrics count them)
                    steps = max(1, min(event.num_steps, used))
                    event = replace(event, token_ids=event.token_ids[:used], logprobs=event.logprobs[:used], num_steps=steps)
                self.num_completion_tokens += len(event.token_ids)
                if self.metrics is not None:
                    self.metrics.on_event(event)
                prompt_lps = None
                if event.prompt_logprobs is not None and not self.got_prompt_logprobs:  # once: a migrated request resends them
                    prompt_lps, self.got_prompt_logprobs = event.prompt_logprobs, True
                if delta.finish_reason is not None:
                    if delta.cut_short:
                        self.client.abort(self.request_id)  # the engine would go on generating
                    self.finished = True
                    self._finish(delta.finish_reason)
                    yield Piece(
                        delta.text,
                        event.token_ids,
                        event.logprobs,
                        delta.finish_reason,
                        delta.stop_reason,
                        prompt_lps,
                        self.num_completion_tokens,
                    )
                    return
                if delta.text or event.token_ids:
                    yield Piece(
                        delta.text,
                        event.token_ids,
                        event.logprobs,
                        prompt_logprobs=prompt_lps,
                        completion_tokens=self.num_completion_tokens,
                    )
        finally:
            if self.finished:
                self.client.release(self.request_id)
            else:  # the consumer went away (client disconnect) or something raised
                self.client.abort(self.request_id)
                self._finish("abort")

    def _finish(self, reason: str) -> None:
        """The request ended: counted (unless the engine rejected it: it never ran, as in vLLM) and logged."""
        if self.metrics is not None and reason != "rejected":
            self.metrics.finish(reason)
        if self.log is not None:
            self.log.emit(self.handle, self.client.gateway_id, len(self.prompt_token_ids), self.num_completion_tokens, reason)
