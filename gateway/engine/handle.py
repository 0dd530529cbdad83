"""One request in flight from a gateway (`RequestHandle`), and the engine events it receives."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineEvent:
    """New tokens of one request (possibly none), and whether and why it ended."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    queue_time_s: float | None = None  # on a request's first output from an engine (see `StepOutputs`)
    stop_reason: int | None = None  # on the last: the stop token id that ended it (see `StepOutputs`)
    replayed: bool = False  # from a journal: another gateway delivered these tokens first
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first output, if asked for
    num_steps: int = 1  # engine steps whose tokens this event carries (see `gateway.engine.outputs`)


@dataclass(slots=True)
class RequestHandle:
    """One request in flight from this gateway, and what it takes to continue it elsewhere."""

    # This gateway's id for the request, unique in the deployment: the engine request id of its first
    # attempt. The response id the client sees, unless the client chose that (``X-Request-Id``):
    # then this is that id with a random suffix, as in vLLM, so two requests that share it never mix.
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    journal_id: str = ""  # a resumable stream's response id: its journal is ``journal:<journal_id>``
    engine_request_id: str = ""  # the current attempt's id in the engine
    scheduler_id: str = ""
    incarnation: str = ""
    attempts: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    events: asyncio.Queue[EngineEvent] = field(default_factory=asyncio.Queue)
    done: bool = False
    unrouted_since: float | None = None  # waiting for a live engine to migrate to
    sync_from: int = -1  # a resend from this index was asked for (-1: none pending)
    resend_owed: bool = False  # outputs were lost and asking for them failed: ask again
    failed_routes: int = 0  # attempts whose send failed (not moves made: `EngineClient.migration_limit`)
    journal_writes: int = 0  # journal writes of its events in flight (it is not moved meanwhile)
    group_id: str = ""  # shared by one prompt's ``n`` sibling requests (`GenerateRequest.group_id`)
    prefer_engine: str = ""  # a sibling's engine: the first attempt goes there if it is live
    journaled_at: float = 0.0  # time.monotonic() of this gateway's last write to the journal (0: none yet)
    priority: int = 0  # `GenerateRequest.priority`, sent again with every attempt
    cache_salt: str = ""  # `GenerateRequest.cache_salt`, likewise

    @property
    def next_index(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def base_request_id(engine_request_id: str) -> str:
    """The request id of an attempt's engine request id (attempt n > 1 runs as ``<id>~<n-1>``)."""
    base, tilde, number = engine_request_id.rpartition("~")
    return base if tilde and number.isdigit() else engine_request_id


def attempt_of(engine_request_id: str) -> int:
    """How many attempts came before this one (0 for the first, ``n`` for ``<id>~<n>``)."""
    _, tilde, number = engine_request_id.rpartition("~")
    return int(number) if tilde and number.isdigit() else 0


class EngineUnavailable(RuntimeError):
    """No live engine to serve requests (answered as 503)."""


class RequestIdInUse(RuntimeError):
    """A response id a client chose already names a stream in flight or still resumable (its
    journal exists), or a stream this gateway is already serving (answered as 409)."""
