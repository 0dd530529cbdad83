"""Sampling parameters: the per-request knobs of decoding, validated once at the edge."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from common.structured_outputs import StructuredOutputsParams

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

    Penalties and biases follow vLLM (applied to the logits in this order, before temperature
    and the filters): ``logit_bias`` adds its bias to each listed token id; ``repetition_penalty``
    (transformers' semantics) divides the positive logits and multiplies the negative ones of
    every token in the prompt or the output so far; ``frequency_penalty`` subtracts itself times
    the number of times a token was generated, ``presence_penalty`` itself once if it was
    (OpenAI's semantics: generated tokens only). 0, 0, 1 and no bias leave the logits alone.

    ``n`` samples per prompt (vLLM's): each is an engine request of its own, sibling ``i`` seeded
    with ``seed + i``; ``best_of`` (>= ``n``) of them are generated and the ``n`` with the highest
    cumulative logprob returned (`common.parallel_sampling`). ``prompt_logprobs`` is how many top
    logprobs to return per prompt token (None: none; the first prompt token has none).
    ``structured_outputs`` constrains the text to a JSON schema, regex, choice or grammar
    (`common.structured_outputs`); the request ends with EOS once the constraint is complete.
    ``allowed_token_ids`` (vLLM's): the only tokens it may produce (EOS too only if listed).
    ``bad_words_token_ids`` (vLLM's ``bad_words``, tokenized): token sequences the output may not
    contain; a sequence's last token is banned wherever the output ends with the rest of it.
    Neither goes with ``structured_outputs``. Where the bans (these, or EOS before ``min_tokens``)
    would leave a row no token at all, that row's bans are lifted for the step.

    Output processing (vLLM's fields; the frontend's alone, never sent to the engine: see
    `sampling_to_dict`): ``stop`` strings end the text before the first of them (after it with
    ``include_stop_str_in_output``, which also keeps the text of the token that stopped the engine);
    ``skip_special_tokens`` leaves special tokens out of the text.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    best_of: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    # The most top logprobs a request may ask for; bounds the executor's top-k work.
    MAX_LOGPROBS = 20
    # The most stop token ids a request may give: the scheduler checks each new token against
    # them every step, so a huge list would slow every request in the batch.
    MAX_STOP_TOKEN_IDS = 1024
    # The most tokens a request may bias: the biases travel to the executor's device every step.
    MAX_LOGIT_BIAS = 1024
    # The most token ids ``allowed_token_ids`` may list (they go to the executor's device once).
    MAX_ALLOWED_TOKEN_IDS = 32768
    # ``bad_words_token_ids``: at most this many sequences, of this many tokens in all (vLLM's
    # limits); each is matched against the request's output every step.
    MAX_BAD_WORDS = 128
    MAX_BAD_WORDS_TOKENS = 1024
    # OpenAI's ranges for the penalties and the biases.
    MAX_PENALTY = 2.0
    # Logits are float32: dividing by a penalty near 0 (or multiplying by a huge one) overflows them
    # into inf and NaN, and an integer past 2**64 cannot even be encoded. Useful values are ~1-2.
    REPETITION_PENALTY_RANGE = (0.01, 100.0)
    MAX_LOGIT_BIAS_VALUE = 100.0
    # The most samples (``n``, ``best_of``) one prompt may ask for: each is a request in the engine.
    MAX_N = 128

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field (the message starts with its name).

        Counts and token ids must fit int32 and seeds int64 (how the engine stores them), so no
        value can overflow downstream; with ``vocab_size``, stop token ids and ``logit_bias`` token
        ids must lie in the vocabulary.
        """
        self.validate_lengths()
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {reprlib.repr(self.stop)}")
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
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not _is_int(self.n) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= self.MAX_N):
            raise ValueError(f"best_of must be an integer in [n, {self.MAX_N}] (n = {self.n}), got {self.best_of!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or len(ids) > self.MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be a list of at most {self.MAX_STOP_TOKEN_IDS} token ids")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT32_MAX}], got {_preview(ids)}")
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}) (the vocabulary), got {_preview(ids)}")
        most = self.MAX_PENALTY
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -most <= value <= most:
                raise ValueError(f"{name} must be in [{-most}, {most}], got {value!r}")
        rep, (low, high) = self.repetition_penalty, self.REPETITION_PENALTY_RANGE
        if not _is_num(rep) or not low <= rep <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {reprlib.repr(rep)}")
        self._validate_logit_bias(vocab_size)
        self._validate_allowed_token_ids(vocab_size)
        self._validate_bad_words(vocab_size)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()

    def validate_lengths(self) -> None:
        """`validate`'s checks of ``max_tokens`` and ``min_tokens`` alone: enough for a copy of
        validated parameters with another ``max_tokens`` (the prompts of one request)."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            raise ValueError(f"min_tokens must be an integer in [0, {INT32_MAX}], got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    def _validate_allowed_token_ids(self, vocab_size: int | None) -> None:
        ids = self.allowed_token_ids
        if ids is None:
            return
        most = self.MAX_ALLOWED_TOKEN_IDS
        if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= most:
            raise ValueError(f"allowed_token_ids must be a list of 1 to {most} token ids")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(f"allowed_token_ids must be integers in [0, {INT32_MAX}], got {_preview(list(ids))}")
        if vocab_size is not None and max(ids) >= vocab_size:
            outside = [t for t in ids if t >= vocab_size]
            raise ValueError(f"allowed_token_ids must be in [0, {vocab_size}) (the vocabulary), got {_preview(outside)}")
        if self.structured_outputs is not None:
            raise ValueError("allowed_token_ids cannot be combined with structured outputs (the grammar decides the tokens)")

    def _validate_bad_words(self, vocab_size: int | None) -> None:
        words = self.bad_words_token_ids
        if words is None:
            return
        most, total = self.MAX_BAD_WORDS, self.MAX_BAD_WORDS_TOKENS
        if not isinstance(words, (list, tuple)) or len(words) > most:
            raise ValueError(f"bad_words_token_ids must be a list of at most {most} token id sequences")
        if not all(isinstance(w, (list, tuple)) and w for w in words) or sum(len(w) for w in words) > total:
            raise ValueError(f"bad_words_token_ids must be non-empty token id sequences of at most {total} ids in all")
        ids = [t for w in words for t in w]
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(f"bad_words_token_ids must be integers in [0, {INT32_MAX}], got {_preview(ids)}")
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            outside = [t for t in ids if t >= vocab_size]
            raise ValueError(f"bad_words_token_ids must be in [0, {vocab_size}) (the vocabulary), got {_preview(outside)}")
        if words and self.structured_outputs is not None:
            raise ValueError("bad_words_token_ids cannot be combined with structured outputs (the grammar decides the tokens)")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > self.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a map of at most {self.MAX_LOGIT_BIAS} token ids to biases")
        ids = list(bias)
        wrong = [t for t in ids if not (_is_int(t) and 0 <= t <= INT32_MAX)]
        if wrong:
            raise ValueError(f"logit_bias token ids must be integers in [0, {INT32_MAX}], got {reprlib.repr(wrong[0])}")
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            outside = [t for t in ids if t >= vocab_size]
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}) (the vocabulary), got {_preview(outside)}")
        most = self.MAX_LOGIT_BIAS_VALUE
        bad_values = [b for b in bias.values() if not (_is_num(b) and -most <= b <= most)]
        if bad_values:
            raise ValueError(f"logit_bias values must be numbers in [{-most}, {most}], got {reprlib.repr(bad_values[0])}")

    @property
    def penalized(self) -> bool:
        """Any presence, frequency or repetition penalty: sampling needs the token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """Pick the argmax: a temperature below `GREEDY_TEMPERATURE`, or ``top_k == 1``."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


# -- the plain map that carries it on the wire ---------------------------------------------------
# Output processing happens in the frontend (`gateway.output.processor`): the engine never needs it.
OUTPUT_FIELDS = frozenset({"stop", "include_stop_str_in_output", "skip_special_tokens"})
_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams) if f.name not in OUTPUT_FIELDS]


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    """`SamplingParams` as the plain map carried by `GenerateRequest` and `SchedulerOutput`: the
    engine's fields, without the frontend's `OUTPUT_FIELDS`.

    ``logit_bias`` travels as ``[[token id, bias], ...]``: msgpack map keys must be strings here
    (the codec decodes with ``strict_map_key``). `sampling_from_dict` undoes it.
    """
    out = {name: getattr(params, name) for name in _SAMPLING_FIELDS}
    if params.logit_bias is not None:
        out["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]
    if params.structured_outputs is not None:
        out["structured_outputs"] = params.structured_outputs.to_dict()
    return out


def wire_size(params: SamplingParams) -> int:
    """The bytes ``params`` take in a message (`sampling_to_dict`, encoded)."""
    return len(msgpack.packb(sampling_to_dict(params), use_bin_type=True))


def sampling_from_dict(sampling: dict[str, Any]) -> SamplingParams:
    """The `SamplingParams` of a map from `sampling_to_dict` (not validated: call ``validate``).

    Raises ``TypeError`` for unknown fields and ``ValueError`` for a malformed ``logit_bias``;
    ``structured_outputs`` travels as `StructuredOutputsParams.to_dict`'s map.
    """
    bias = sampling.get("logit_bias")
    if isinstance(bias, list):
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in bias):
            raise ValueError("logit_bias must be a list of [token id, bias] pairs")
        sampling = {**sampling, "logit_bias": {token: value for token, value in bias}}
    structured = sampling.get("structured_outputs")
    if isinstance(structured, dict):
        sampling = {**sampling, "structured_outputs": StructuredOutputsParams.from_dict(structured)}
    return SamplingParams(**sampling)
