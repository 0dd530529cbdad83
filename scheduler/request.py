"""A request's life inside the scheduler, and what one engine step reports about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: a request is itself alone. The queues find and remove requests with ``==``, and the
# generated one would compare every field of two requests per element.
@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    ``num_computed_tokens`` counts tokens whose K/V sit in the cache; the scheduler's only
    per-request progress variable (no prefill/decode phases); it advances when a step is scheduled.
    ``num_output_placeholders`` counts tokens that scheduled steps will sample but whose results
    have not arrived (fewer than the steps in flight: one, one step ahead). Preemption resets
    ``num_computed_tokens`` to 0 and the request recomputes prompt plus the tokens it has already
    generated (less what the prefix cache still holds). ``cache_salt`` keeps its prefix-cache
    entries apart from those of requests with another salt (or none); ``block_hashes`` are its
    full blocks' chained hashes, filled by the `CacheManager`. ``group_id``: shared by the sibling requests of one prompt's
    ``n`` samples (see `Scheduler`: a sibling waits for another's prompt blocks to be cached).
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, one entry per prompt token after
    the first, filled as prefill steps compute them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id (of ``stop_token_ids``) that ended it; EOS: None
    num_preemptions: int = 0
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    scheduled_time: float | None = None  # first scheduled (time.monotonic, as ``arrival_time``)
    group_id: str | None = None
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they went out (with its first output of this engine)
    sampling_bytes: int = 0  # its sampling parameters' encoded size (`scheduler.step_bytes`)
    priority: int = 0  # lower is served first under the priority policy (`scheduler.request_queue`)

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to first scheduling (vLLM's queue time); None until scheduled. A preempted
        request's wait to resume is not counted, as in vLLM."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def stop_reason_for(self, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
        """The finish reason ``token`` (just appended) ends it with, or None. A stop token id
        (checked after EOS, as in vLLM) is also kept as its ``stop_reason``."""
        params = self.sampling_params
        n = self.num_output_tokens
        if n >= params.min_tokens:
            # A grammar forces EOS once it is complete: that ends the request even with ignore_eos.
            if (not params.ignore_eos or params.structured_outputs is not None) and token in eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                self.stop_reason = token
                return "stop"
        if n >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def check_servable(self, max_model_len: int, vocab_size: int) -> None:
        """``ValueError``, saying why, unless an executor of this context length and vocabulary can
        serve it to its end (at admission, and when another executor takes over)."""
        if any(not 0 <= t < vocab_size for t in self.prompt_token_ids) or any(
            not 0 <= t < vocab_size for t in self.output_token_ids
        ):
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        n, max_tokens = len(self.prompt_token_ids), self.sampling_params.max_tokens
        if n + max_tokens > max_model_len:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})")

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and does not have them all (so it must compute every prompt position)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request (new tokens, and whether it ended)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float] | None]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_output_tokens: int  # generated so far, including new_token_ids
    queue_time_s: float | None = None  # `Request.queue_time_s` (the router sends it once per request)
    stop_reason: int | None = None  # on the last output: the stop token id that ended it (vLLM's)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, with the first output (if asked for)
