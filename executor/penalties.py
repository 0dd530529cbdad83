"""Logit bias and presence/frequency/repetition penalties (vLLM's semantics), batched on the device.

`apply_logit_bias` adds each request's ``logit_bias``; `apply_penalties` penalises the tokens a
request has seen, from its rows of a `TokenCountPool`: per request with penalties, whether each
token is in its prompt and how many times it was generated. The pool's rows are kept up to date
step by step (each token is added once, see `executor.input_batch.TokenCountStep`), so a step's
cost is one gather of the penalised rows, not a recount of their tokens. Rows without penalties
or biases are never touched, and a batch with none of them costs nothing. `BadWords`: the
tokens a request's ``bad_words_token_ids`` ban at its next step (host-side, from its output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from executor.input_batch import TokenCountStep


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [N, vocab] plus row ``i``'s ``params[i].logit_bias`` (a new tensor)."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            tokens.extend(p.logit_bias)
            values.extend(p.logit_bias.values())
    if not rows:
        return logits
    dev = logits.device
    index = torch.tensor([rows, tokens], dtype=torch.int64, device=dev)
    return logits.index_put((index[0], index[1]), torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised ``logits`` [P, vocab] (a new tensor), as vLLM computes them.

    ``prompt_mask`` [P, vocab] (bool): the token is in the row's prompt; ``output_counts``
    [P, vocab]: times it was generated; ``presence``, ``frequency``, ``repetition`` [P].
    Repetition (transformers): a logit of a token in the prompt or the output is divided by the
    penalty if positive, else multiplied. Then frequency times the count and presence (once, if
    generated at all) are subtracted: OpenAI's penalties count generated tokens only.
    """
    generated = output_counts > 0
    rep = repetition[:, None]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | generated, repeated, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * generated


@dataclass(slots=True)
class TokenCounts:
    """The token counts of the sampled rows with penalties, for `Sampler.sample`.

    ``rows``: their indices among the sampled rows (ascending); ``prompt_mask`` and
    ``output_counts``: their rows of the `TokenCountPool`, in the same order.
    """

    rows: list[int]
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor


def penalize(logits: torch.Tensor, params: list[SamplingParams], counts: TokenCounts) -> torch.Tensor:
    """`apply_penalties` on ``counts.rows`` of ``logits`` [N, vocab] (a new tensor)."""
    dev = logits.device
    chosen = [params[j] for j in counts.rows]
    scalars = torch.tensor(
        [[p.presence_penalty for p in chosen], [p.frequency_penalty for p in chosen], [p.repetition_penalty for p in chosen]],
        dtype=logits.dtype,
        device=dev,
    )
    if len(counts.rows) == logits.shape[0]:  # every row (rows are distinct and ascending)
        return apply_penalties(logits, counts.prompt_mask, counts.output_counts, *scalars.unbind(0))
    index = torch.tensor(counts.rows, dtype=torch.int64, device=dev)
    rows = apply_penalties(logits.index_select(0, index), counts.prompt_mask, counts.output_counts, *scalars.unbind(0))
    return logits.index_copy(0, index, rows)


class TokenCountPool:
    """Per-request token statistics on the device, one row (slot) per request with penalties.

    ``prompt_mask`` [slots, vocab] (bool): the token is in the request's prompt (marked only for
    a repetition penalty, its one reader); ``output_counts`` [slots, vocab] (int32): times the
    request generated it. `executor.input_batch.PersistentBatch` assigns the slots and says what
    is new each step (`update`). The pool grows (doubling) to the most requests with penalties
    held at once; `clear` frees it.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.prompt_mask = torch.zeros((0, self.vocab_size), dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros((0, self.vocab_size), dtype=torch.int32, device=self.device)

    def _grow(self, num_slots: int) -> None:
        old = self.prompt_mask.shape[0]
        size = max(num_slots, 2 * old)
        mask = torch.zeros((size, self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((size, self.vocab_size), dtype=torch.int32, device=self.device)
        mask[:old] = self.prompt_mask
        counts[:old] = self.output_counts
        self.prompt_mask, self.output_counts = mask, counts

    def update(self, step: TokenCountStep) -> None:
        """Zero the newly assigned slots, mark prompt tokens, count new output tokens."""
        dev = self.device
        if step.reset:
            if max(step.reset) >= self.prompt_mask.shape[0]:
                self._grow(max(step.reset) + 1)
            reset = torch.tensor(step.reset, dtype=torch.int64, device=dev)
            self.prompt_mask[reset] = False
            self.output_counts[reset] = 0
        if step.prompt_slots:
            index = torch.tensor([step.prompt_slots, step.prompt_tokens], dtype=torch.int64, device=dev)
            self.prompt_mask[index[0], index[1]] = True
        if step.output_slots:
            index = torch.tensor([step.output_slots, step.output_tokens], dtype=torch.int64, device=dev)
            ones = torch.ones(index.shape[1], dtype=torch.int32, device=dev)
            self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def gather(self, rows: list[int], slots: list[int]) -> TokenCounts:
        """The counts of sampled rows ``rows``, held in pool ``slots``."""
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return TokenCounts(rows, self.prompt_mask.index_select(0, index), self.output_counts.index_select(0, index))


class BadWords:
    """A request's ``bad_words_token_ids`` (vLLM's ``bad_words``), indexed by each word's next-to-last
    token: a step compares only the words its output's last token may be completing."""

    __slots__ = ("always", "by_last")

    def __init__(self, words: list[list[int]]) -> None:
        self.always = [w[0] for w in words if len(w) == 1]  # one-token words: banned at every step
        self.by_last: dict[int, list[list[int]]] = {}
        for w in words:
            if len(w) > 1:
                self.by_last.setdefault(w[-2], []).append(w)

    def bans(self, tokens: list[int], output_len: int) -> list[int]:
        """The last token of each word whose other tokens end the output (the last ``output_len``
        of ``tokens``)."""
        out = list(self.always)
        for word in self.by_last.get(tokens[-1], ()) if output_len else ():
            before = len(word) - 1
            if before <= output_len and tokens[len(tokens) - before :] == word[:before]:
                out.append(word[-1])
        return out
