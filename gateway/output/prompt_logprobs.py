"""vLLM's ``prompt_logprobs`` response field: per prompt position (None for the first, which
nothing predicts) a map token id -> ``{logprob, rank, decoded_token}`` of the prompt token and
the top ``k`` tokens there, ranks counted in the whole vocabulary (1: the likeliest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.codec import PromptLogprobs, rank_of


def vllm_prompt_logprobs(
    prompt_token_ids: list[int], entries: PromptLogprobs, k: int, token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """The field, from the engine's entries (`common.codec.PromptLogprob`: the prompt token's
    logprob and rank, and at least ``k`` top tokens); JSON keys are the token ids as strings."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        # Every token likelier than the prompt token is among the top ones the engine sent, so
        # the top k's ranks are their places in that order.
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        ranks = {t: place for place, (t, _) in enumerate(top, start=1)}
        ranks[token_id] = rank_of(entry) or ranks.get(token_id, 0)
        position = {token_id: entry.get(token_id)} | dict(top)  # the prompt token first, as vLLM's
        out.append(
            {
                str(t): {"logprob": value, "rank": ranks[t], "decoded_token": token_text(t)}
                for t, value in position.items()
                if value is not None
            }
        )
    return out
