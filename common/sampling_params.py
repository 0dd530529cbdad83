"""Sampling parameters: the per-request knobs of decoding, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Range of the engine's integer columns (token ids, counts) and of a sampling seed.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Temperatures below this sample greedily. Dividing logits by a tinier temperature overflows
# (1e-40 turned every logit into +-inf, softmax into NaN, and the draw into token 0), and the
# distribution is one-hot long before that anyway: a logit gap of 1e-3 at temperature 1e-5 is
# already e^-100.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _preview(values: list[Any]) -> str:
    """A short rendering of a possibly huge list, for an error message."""
    return repr(values) if len(values) <= 8 else f"[{', '.join(map(repr, values[:8]))}, ...] ({len(values)} items)"


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    A ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5; 0 included) means greedy, as does
    ``top_k == 1``. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``logprobs`` is how many top logprobs to return per generated token (None: none at all).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    # The most top logprobs a request may ask for; bounds the executor's top-k work.
    MAX_LOGPROBS = 20
    # The most stop token ids a request may give: the scheduler checks each new token against
    # them every step, so a huge list would slow every request in the batch.
    MAX_STOP_TOKEN_IDS = 1024

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field (the message starts with its name).

        Counts and token ids must fit int32 and seeds int64 (how the engine stores them), so no
        value can overflow downstream; with ``vocab_size``, stop token ids must lie in the vocabulary.
        """
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            raise ValueError(f"min_tokens must be an integer in [0, {INT32_MAX}], got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not _is_num(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be an integer in [-1, {INT32_MAX}] (0 or -1 disables it), got {self.top_k!r}")
        if not _is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or len(ids) > self.MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be a list of at most {self.MAX_STOP_TOKEN_IDS} token ids")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT32_MAX}], got {_preview(ids)}")
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}) (the vocabulary), got {_preview(ids)}")

    @property
    def greedy(self) -> bool:
        """Pick the argmax: a temperature below `GREEDY_TEMPERATURE`, or ``top_k == 1``."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
