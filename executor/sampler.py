"""Token sampling: logit bias, penalties, grammar masks, greedy, temperature, top-k, top-p, min-p, per-request
seeds, logprobs.

The logits are first edited as in vLLM: every token outside a row's ``allowed_token_ids``
masked, ``logit_bias`` added, banned tokens masked, then the presence/frequency/repetition
penalties applied (`executor.penalties`), each only when some row of the batch asks for it.

Rows with ``SamplingParams.greedy`` (a temperature below ``GREEDY_TEMPERATURE``, or top_k 1)
take the argmax and never divide by their temperature, which could overflow. Filters apply in
the order temperature -> top-k -> top-p -> min-p on each row; the choice is an exponential
race, ``argmax(probs / E)`` with ``E ~ Exp(1)``, which draws exactly from ``probs``.
A seeded request draws ``E`` from a generator seeded by ``(seed, output_len)``, so its tokens
depend only on its own seed, prompt and position: not on batch mates, and not on whether it was
preempted and recomputed. Unseeded rows share one engine-level generator.
"""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from executor.grammar import GrammarMask
from executor.penalties import TokenCounts, apply_logit_bias, penalize

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """A well-spread 63-bit generator seed from ``(seed, step)`` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Turns logits into tokens (and logprobs) for one batch step."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._row_gen = torch.Generator(device=self.device)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_lens: list[int],
        banned: list[list[int]] | None = None,
        counts: TokenCounts | None = None,
        grammar: GrammarMask | None = None,
        allowed: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample one token per row of ``logits`` ``[N, vocab]``.

        ``banned[i]`` lists tokens row ``i`` may not produce this step (e.g. EOS before
        ``min_tokens``), unless they are all it has left. ``counts``: the token counts of the rows
        with penalties (the executor's `executor.penalties.TokenCountPool` rows); without them no
        penalty applies. ``grammar``:
        the structured-output rows' token masks (`executor.grammar`), applied last. ``allowed[i]``:
        the only token ids row ``i`` may produce (a device tensor), or None. Returns token
        ids and, per row, ``{token: logprob}`` for the sampled token plus the top
        ``params[i].logprobs`` (None where logprobs were not requested).
        Logprobs come from the raw logits, before biases, penalties, temperature and filters.
        """
        n = logits.shape[0]
        logits = logits.float()
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if allowed is not None:
            logits = keep_only(logits, allowed)
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, params)
        if banned is not None and any(banned):
            rows = [i for i, toks in enumerate(banned) if toks]
            idx = torch.tensor(rows, device=logits.device)
            unbanned = logits.index_select(0, idx)
            logits = logits.clone()
            for i in rows:
                logits[i, banned[i]] = float("-inf")
            # A row whose bans took every token left (its allowed ones) draws as if unbanned.
            kept = logits.index_select(0, idx)
            logits.index_copy_(0, idx, torch.where(torch.isneginf(kept).all(dim=-1, keepdim=True), unbanned, kept))
        if counts is not None:
            logits = penalize(logits, params, counts)
        if grammar is not None:
            logits = grammar.apply(logits)

        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, params, output_lens, greedy)
        token_list: list[int] = tokens.tolist()
        if raw_logprobs is None:
            return token_list, [None] * n
        return token_list, self._logprobs(raw_logprobs, tokens, params, want_lp)

    def _sample_random(
        self, logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int], greedy: list[bool]
    ) -> torch.Tensor:
        dev = logits.device
        # Greedy rows divide by 1 (their argmax is taken below); every other row's temperature is
        # at least GREEDY_TEMPERATURE, so no logit overflows fp32.
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=dev)
        logits = logits / temps[:, None]
        top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_ps = [p.top_p for p in params]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = _top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            # Relative to the top probability, which top-k/top-p renormalisation does not change.
            thresh = torch.tensor(min_ps, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < thresh, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            rows = noise[unseeded] if len(unseeded) < len(params) else noise
            rows.exponential_(generator=self.generator)
            if len(unseeded) < len(params):
                noise[unseeded] = rows
        for i, p in enumerate(params):
            if p.seed is not None:
                self._row_gen.manual_seed(_mix_seed(p.seed, output_lens[i]))
                noise[i].exponential_(generator=self._row_gen)
        sampled = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), sampled)
        return sampled

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams], want: list[bool]
    ) -> list[dict[int, float] | None]:
        top_n = max((p.logprobs or 0) for p in params)
        chosen = raw.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if top_n > 0:
            vals, ids = raw.topk(top_n, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        token_list = tokens.tolist()
        out: list[dict[int, float] | None] = []
        for i, p in enumerate(params):
            if not want[i]:
                out.append(None)
                continue
            entry = {token_list[i]: chosen[i]}
            for j in range(p.logprobs or 0):
                entry.setdefault(top_ids[i][j], top_vals[i][j])
            out.append(entry)
        return out


def keep_only(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> torch.Tensor:
    """``logits`` with every token outside row ``i``'s ``allowed[i]`` at -inf (a new tensor)."""
    out = logits.clone()
    for i, ids in enumerate(allowed):
        if ids is not None:
            kept = logits[i].index_select(0, ids)
            out[i].fill_(float("-inf")).index_copy_(0, ids, kept)
    return out


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    dev = logits.device
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    if any(p < 1.0 for p in top_ps):
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one stays).
        before = probs.cumsum(dim=-1) - probs
        ps = torch.tensor(top_ps, device=dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(before >= ps, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
