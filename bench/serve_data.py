"""`conveyor bench serve`'s requests: prompt material, the random / shared-prefix / jsonl datasets, arrivals."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

DATASETS = ("random", "shared-prefix")
# Token ids sent when the vocabulary is unknown (no --tokenizer): inside every vocabulary we serve
# (the tiny test model has 1024 ids; real ones tens of thousands) and above the special tokens
# that sit at the bottom of most vocabularies (<s>, </s>, <pad>, chat markers).
SAFE_IDS = (16, 1024)

WORDS = """the of and to in is that it for on with as was at by an be this from or are have not but which one all
their there been has when who will more no if out so said what up its about into than them can only other new some could
time these two may then do first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three""".split()


# -- requests and their results ----------------------------------------------------------------
@dataclass(slots=True)
class BenchRequest:
    """One request of the benchmark: its prompt, prompt length if known here, and ``max_tokens``."""

    prompt: str | list[int]
    prompt_len: int | None  # tokens, when known without the server (token ids, or a tokenizer)
    output_len: int


# -- datasets ----------------------------------------------------------------------------------
class TokenSource:
    """Random prompt material: token ids in a range every vocabulary of the model has, and text.

    Without a tokenizer, ids come from `SAFE_IDS` and text is random common words (the server's
    ``usage`` gives the true count); with one, ids avoid its special tokens and text is decoded
    from random ids, re-encoded and cut to length as vLLM's random dataset does.
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.ids = list(range(*SAFE_IDS))
        else:
            special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
            self.ids = [i for i in range(min(SAFE_IDS[0], tokenizer.vocab_size - 1), tokenizer.vocab_size) if i not in special]

    def random_ids(self, rng: random.Random, n: int) -> list[int]:
        """``n`` random token ids of the safe range."""
        return [rng.choice(self.ids) for _ in range(n)]

    def random_text(self, rng: random.Random, n: int) -> str:
        """Text of about ``n`` tokens (exactly, where re-encoding the cut text is stable)."""
        if self.tokenizer is None:
            return " ".join(rng.choice(WORDS) for _ in range(n))
        text = self.tokenizer.decode(self.random_ids(rng, n))
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:n]
        return cast(str, self.tokenizer.decode(ids))

    def count(self, text: str) -> int | None:
        """Tokens of ``text``, when a tokenizer is at hand."""
        return None if self.tokenizer is None else len(self.tokenizer.encode(text, add_special_tokens=False))


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    # vLLM's --random-range-ratio: uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1.
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(
    source: TokenSource,
    n: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    text: bool = False,
    seed: int = 0,
) -> list[BenchRequest]:
    """``n`` prompts of one common prefix of ``prefix_len`` tokens then ``input_len`` (spread by
    ``range_ratio``) random ones; token ids, or ``text`` (for chat)."""
    rng = random.Random(seed)
    in_lens, out_lens = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    out: list[BenchRequest] = []
    if text:
        prefix = source.random_text(rng, prefix_len) + " " if prefix_len else ""
        for i, o in zip(in_lens, out_lens):
            prompt = prefix + source.random_text(rng, i)
            out.append(BenchRequest(prompt, source.count(prompt), o))
        return out
    prefix_ids = source.random_ids(rng, prefix_len)
    for i, o in zip(in_lens, out_lens):
        ids = prefix_ids + source.random_ids(rng, i)
        out.append(BenchRequest(ids, len(ids), o))
    return out


def jsonl_requests(
    path: Path, n: int | None, default_output_len: int, source: TokenSource, chat: bool = False
) -> list[BenchRequest]:
    """Requests from a ``.jsonl`` file, one ``{"prompt": ..., "output_len": ...}`` per line; the
    first ``n`` (lines reused in order when there are fewer), all of them when ``n`` is None."""
    rows: list[BenchRequest] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if chat:  # chat takes text only
                if source.tokenizer is None:
                    raise ValueError(f"{path}:{number}: token-id prompts need --tokenizer for --endpoint chat")
                prompt = cast(str, source.tokenizer.decode(prompt))
        elif not (isinstance(prompt, str) and prompt):
            raise ValueError(f"{path}:{number}: 'prompt' must be a non-empty string or list of token ids")
        output_len = obj.get("output_len", default_output_len)
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
            raise ValueError(f"{path}:{number}: 'output_len' must be a positive integer")
        prompt_len = len(prompt) if isinstance(prompt, list) else source.count(prompt)
        rows.append(BenchRequest(prompt, prompt_len, output_len))
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows if n is None else [rows[i % len(rows)] for i in range(n)]


def arrival_delays(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before sending each of ``n`` requests: Poisson arrivals at ``rate`` per
    second (exponential gaps, the first request at once), all zero when ``rate`` is infinite."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]
