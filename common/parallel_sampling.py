"""Parallel sampling (``n`` > 1, ``best_of``): one prompt fanned out into sibling requests.

vLLM's semantics (its ``ParentRequest``): a request with ``n`` samples runs as ``best_of or n``
child requests of its own, which the engine schedules like any other; child ``i`` of a seeded
request uses ``seed + i`` (so the samples differ and each is reproducible), and an unseeded child
draws from the engine's generator. With ``best_of`` > ``n`` every child also returns the logprob of
each token it sampled, and the ``n`` children with the highest cumulative logprob are returned.
Prompt logprobs are the same for every child, so only child 0 computes them (the others then
share the prompt's KV blocks through the prefix cache: see `scheduler.scheduler`).

Used by the offline `LLM` and by the gateway alike, so both fan out and rank identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from common.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

_SEED_SPAN = INT64_MAX - INT64_MIN + 1


def num_children(params: SamplingParams) -> int:
    """How many engine requests ``params`` runs as: ``best_of`` if given, else ``n``."""
    return params.best_of if params.best_of is not None else params.n


def ranks_by_logprob(params: SamplingParams) -> bool:
    """Whether the returned samples are chosen by cumulative logprob (``best_of`` > ``n``)."""
    return num_children(params) > params.n


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The `SamplingParams` of child ``index``: one sample (``n`` 1, no ``best_of``), seed
    ``seed + index`` (wrapped into int64), logprobs of the sampled token when ranking needs them,
    and prompt logprobs for child 0 only."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - INT64_MIN) % _SEED_SPAN + INT64_MIN
    logprobs = params.logprobs
    if logprobs is None and ranks_by_logprob(params):
        logprobs = 0  # the sampled token's logprob, for the cumulative logprob
    return replace(
        params,
        n=1,
        best_of=None,
        seed=seed,
        logprobs=logprobs,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        stop_token_ids=list(params.stop_token_ids),
        logit_bias=dict(params.logit_bias) if params.logit_bias is not None else None,
    )


def cumulative_logprob(token_ids: Sequence[int], logprobs: Sequence[dict[int, float] | None]) -> float | None:
    """Sum of the sampled tokens' logprobs; None if any is missing (logprobs were not computed)."""
    total = 0.0
    for token, entry in zip(token_ids, logprobs):
        if entry is None or token not in entry:
            return None
        total += entry[token]
    return total if len(logprobs) >= len(token_ids) else None


def select_best(cumulative: Sequence[float | None], n: int) -> list[int]:
    """Indices of the ``n`` children to return: all in order when there are ``n``; else the ``n``
    highest cumulative logprobs, best first (vLLM's order), ties by index."""
    if len(cumulative) <= n:
        return list(range(len(cumulative)))
    scores = [float("-inf") if c is None else c for c in cumulative]
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n]
