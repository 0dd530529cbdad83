"""vLLM's request fields beyond OpenAI's: the ones this server honours, parsed here for
`gateway.openai.schema`, and the ones it refuses unless neutral (ignored, they would look like
support). Each parser gives a 400 naming its field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.protocol import EngineStatus
from common.sampling_params import INT32_MAX, SamplingParams
from gateway.http.errors import bad
from gateway.openai.json_input import all_ints, get_field, get_int, preview

# A cache salt longer than this protects no better (vLLM suggests 43 base64 characters, 256 bits).
MAX_CACHE_SALT_CHARS = 1024
# A bad word longer than this is no word (each is tokenized twice, on a worker thread).
MAX_BAD_WORD_CHARS = 256


def refuse_unless_neutral(body: dict[str, Any], name: str, neutral: Any) -> None:
    """A 400 when ``name`` is given with another value than ``neutral`` (None is absent)."""
    value = body.get(name)
    if value is not None and value != neutral:
        raise bad(f"'{name}' = {preview(value)} is not supported by this server (only {neutral!r})", name)


# vLLM's sampling extensions this server does not honour: refused unless neutral (ignored, they
# would look like support).
UNSUPPORTED_VLLM_FIELDS: tuple[tuple[str, Any], ...] = (
    ("use_beam_search", False),
    ("length_penalty", 1.0),
    # (inputs and hooks of vLLM's own: prompts as embeddings, custom logits processors, its
    # disaggregated prefill's KV transfer, and its extra-arguments escape hatch)
    ("prompt_embeds", None),
    ("logits_processors", []),
    ("kv_transfer_params", {}),
    ("vllm_xargs", {}),
)

# vLLM's chat-template fields this server does not honour (the checkpoint's own template renders
# every chat; a request's own template is a program vLLM too runs only when its operator allows):
# refused when they ask for anything else, by /v1/chat/completions and /tokenize alike.
CHAT_TEMPLATE_FIELDS: tuple[tuple[str, Any], ...] = (
    ("chat_template", None),
    ("documents", None),  # (a RAG template's input; it was ignored, the documents silently gone)
)


def parse_truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: -1 (the model's context) or a count of at least 1."""
    value = get_int(body, "truncate_prompt_tokens", None)
    if value is not None and not (value == -1 or 1 <= value <= INT32_MAX):
        raise bad(
            f"'truncate_prompt_tokens' must be -1 (the model's context) or in [1, {INT32_MAX}], got {value}",
            "truncate_prompt_tokens",
        )
    return value


def parse_cache_salt(body: dict[str, Any]) -> str:
    """vLLM's ``cache_salt``: a non-empty string (a secret, random and long: it keeps a tenant's
    prompts from being guessed through prefix-cache hits), at most `MAX_CACHE_SALT_CHARS`."""
    value = get_field(
        body,
        "cache_salt",
        lambda v: isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT_CHARS,
        f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
        "",
    )
    return str(value)


def parse_priority(body: dict[str, Any]) -> int:
    """vLLM's ``priority``: an int32 (the engine's integer columns), lower first."""
    value = get_int(body, "priority", 0)
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise bad(f"'priority' must be in [{-INT32_MAX - 1}, {INT32_MAX}], got {value}", "priority")
    return value


def parse_bad_words(body: dict[str, Any], sampling: SamplingParams) -> list[str]:
    """vLLM's ``bad_words``: at most `SamplingParams.MAX_BAD_WORDS` strings with some text."""
    most = SamplingParams.MAX_BAD_WORDS
    words = get_field(
        body,
        "bad_words",
        lambda v: isinstance(v, list) and len(v) <= most and all(isinstance(w, str) for w in v),
        f"an array of at most {most} strings",
        [],
    )
    if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise bad(f"'bad_words' must hold words of 1 to {MAX_BAD_WORD_CHARS} characters, not only spaces", "bad_words")
    if words and sampling.structured_outputs is not None:
        raise bad("'bad_words' cannot be combined with structured outputs (the grammar decides the tokens)", "bad_words")
    return list(words)


def parse_allowed_token_ids(body: dict[str, Any]) -> list[int] | None:
    """vLLM's ``allowed_token_ids``, a bounded list of integers (checked against the vocabulary once
    it is known: `SamplingParams.validate`)."""
    most = SamplingParams.MAX_ALLOWED_TOKEN_IDS
    value = get_field(
        body,
        "allowed_token_ids",
        lambda v: isinstance(v, list) and 1 <= len(v) <= most and all_ints(v),
        f"an array of 1 to {most} token ids",
        None,
    )
    return None if value is None else list(value)


def check_priority(priority: int, engines: Iterable[EngineStatus]) -> None:
    """A 400 for a non-zero ``priority`` where no engine runs the priority scheduling policy
    (vLLM's rule; an fcfs engine would refuse the request)."""
    if priority and not any(e.scheduling_policy == "priority" for e in engines):
        raise bad(
            f"'priority' = {priority} needs an engine started with --scheduling-policy priority (the engines here serve fcfs)",
            "priority",
        )
