"""Prompt logprobs (``SamplingParams.prompt_logprobs``): log-softmax over prompt positions.

During prefill (a whole prompt, or a chunk of it when prefill is chunked), the hidden state at
prompt position ``p`` predicts prompt token ``p + 1``; for the requests that asked, those rows get
logits too (normally only each sequence's last row does), and each yields ``{token: logprob}`` for
the actual prompt token plus the top-k, from the raw logits (as generated-token logprobs, and
vLLM's), and the prompt token's rank in the vocabulary (`PromptLogprob`). Rows are taken chunk by
chunk, so memory stays bounded by the step's token budget.
"""

from __future__ import annotations

from typing import Protocol

import torch

from common.codec import PromptLogprob
from executor.input_batch import Batch

PromptLogprobs = list[dict[int, float] | None]


class LogitsModel(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def prompt_logits(model: LogitsModel, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The logits of the prompt positions ``batch.prompt_lp`` asks for (with tensor parallelism,
    a collective every rank joins; what follows is rank 0's alone)."""
    starts = [0]
    for q in batch.query_lens:
        starts.append(starts[-1] + q)
    rows: list[int] = []
    for i, count, _ in batch.prompt_lp:
        rows.extend(range(starts[i], starts[i] + count))
    return model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=hidden.device)))


def prompt_logprobs_of(logits: torch.Tensor, batch: Batch) -> list[PromptLogprobs | None]:
    """Per sequence of ``batch``: the logprob entries of the prompt tokens its step predicts, in
    order (None for sequences without ``prompt_lp``), from the logits of `prompt_logits`."""
    dev = logits.device
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(batch.prompt_lp_targets, dtype=torch.int64, device=dev)
    chosen_t = logprobs.gather(1, targets[:, None])
    # vLLM's rank: 1 + how many tokens are likelier than the prompt token (ties share a rank).
    ranks: list[int] = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
    chosen: list[float] = chosen_t.squeeze(1).tolist()
    top_n = max(k for _, _, k in batch.prompt_lp)
    top_ids: list[list[int]] = []
    top_vals: list[list[float]] = []
    if top_n > 0:
        vals, ids = logprobs.topk(top_n, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out: list[PromptLogprobs | None] = [None] * batch.num_seqs
    r = 0
    for i, count, k in batch.prompt_lp:
        entries: PromptLogprobs = []
        for _ in range(count):
            entry = PromptLogprob({batch.prompt_lp_targets[r]: chosen[r]}, ranks[r])
            for j in range(k):
                entry.setdefault(top_ids[r][j], top_vals[r][j])
            entries.append(entry)
            r += 1
        out[i] = entries
    return out
