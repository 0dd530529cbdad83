"""`ExecutorOutput`: what one executed step returns to the scheduler (in process or from the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ExecutorOutput:
    """One entry per scheduled request, in the step's order.

    ``token_ids[i]`` is the sampled token, or -1 where the request did not sample (a prefill chunk
    that does not reach the end of its tokens). ``logprobs[i]`` maps token id -> logprob (sampled
    token plus the top-N) or is None; the list is empty when no request asked for logprobs.
    ``prompt_logprobs[i]``: for a request with ``prompt_logprobs``, one entry per prompt position
    the step computed that predicts a prompt token (positions ``start .. min(end, P - 1) - 1``:
    the logprobs of prompt tokens ``start + 1 ..``), else None; empty when no request has any.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs: list[list[dict[int, float] | None] | None] = field(default_factory=list)
