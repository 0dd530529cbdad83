"""OpenAI request parsing and validation (the error format is `gateway.openai.json_input.ApiError`).

Parsing is by hand rather than with pydantic models so every rejection carries OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}`` with a message that names the field
and what was wrong. Unknown fields are ignored (clients send many); fields whose non-default
values we cannot honour (``suffix``, ``best_of`` on chat...) are rejected. Structured outputs
and tools are parsed in `gateway.openai.structured`, vLLM's own fields in `gateway.openai.vllm_fields`.

No input gets past here as a 500 or as work that would slow other requests: the body has been
through `gateway.openai.json_input` (JSON, bounded nesting, valid Unicode; typed getters);
integers are range-checked (`SamplingParams.validate`); lists are bounded, since parsing runs on
the event loop, except prompt token ids, which `check_token_ids` checks later in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.sampling_params import INT32_MAX, SamplingParams
from gateway.http.errors import bad
from gateway.openai.chat_messages import TemplateOptions, parse_messages, parse_template_options
from gateway.openai.json_input import (
    all_ints,
    get_bool,
    get_field,
    get_int,
    get_num,
    is_int,
    is_num,
    json_size,
    preview,
    typename,
)
from gateway.openai.structured import StructuredRequest, parse_structured, parse_tools
from gateway.openai.vllm_fields import (
    CHAT_TEMPLATE_FIELDS,
    UNSUPPORTED_VLLM_FIELDS,
    parse_allowed_token_ids,
    parse_bad_words,
    parse_cache_salt,
    parse_priority,
    parse_truncate_prompt_tokens,
    refuse_unless_neutral,
)

MAX_STOP_STRINGS = 16
# Stop strings are matched (and partial matches held back) on every streamed token; the cost of
# holding back grows with the square of a stop string's length.
MAX_STOP_STRING_CHARS = 256
# About how many bytes of a JSON body one token id takes, to size inputs given as ids.
BYTES_PER_TOKEN_ID = 4
# The most prompts one /v1/completions request may list (each runs as ``best_of or n`` requests).
MAX_PROMPTS = 256


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """A gateway's parsers of free-form chat output (by name): ``tools`` reads the calls of
    ``tool_choice`` "auto" (None: "auto" is a 400), ``reasoning`` a thinking model's reasoning
    (None: it stays in the content)."""

    tools: str | None = None
    reasoning: str | None = None


@dataclass(slots=True)
class GenerationSpec:
    """A validated completion or chat request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str | None
    sampling: SamplingParams
    max_tokens: int | None  # None: fill the context (chat default)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # checked with the model's vocabulary: `check_token_ids`
    prompts: list[str | list[int]] | None = None  # a list of several prompts (completions); then ``prompt*`` are None
    messages: list[dict[str, Any]] | None = None
    stream: bool = False
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs on the response (top-k as given)
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries the usage so far, not only the last
    add_special_tokens: bool = True
    echo: bool = False
    logprobs: int | None = None  # top-N per token; None: no logprobs
    structured: StructuredRequest | None = None  # structured output / tools (`gateway.openai.structured`)
    # vLLM's: keep only the prompt's last this many tokens (-1: the model's context; `keep_tokens`)
    truncate_prompt_tokens: int | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" (a token's text may not be valid UTF-8 alone)
    return_tokens_as_token_ids: bool = False
    # vLLM's: words the output may not contain (tokenized with the prompt: `bad_words_token_ids`)
    bad_words: list[str] = field(default_factory=list)
    priority: int = 0  # vLLM's: lower first, for an engine with the priority scheduling policy
    cache_salt: str = ""  # vLLM's: keeps the request's prefix-cache entries apart ("": none)
    return_token_ids: bool = False  # vLLM's: responses carry the prompt's and the output's token ids
    template: TemplateOptions = field(default_factory=TemplateOptions)  # chat: how its template renders
    reasoning_parser: str | None = None  # chat: splits the reasoning off the content (`gateway.output.reasoning_parsers`)
    include_reasoning: bool = True  # vLLM's: false drops the reasoning from the response
    reasoning_phase: str = ""  # where the rendered prompt leaves the output (`reasoning_parsers.prompt_phase`)

    def input_size(self) -> int:
        """About how many bytes the prompt is, to tell large inputs apart."""
        return (
            len(self.prompt or "")
            + BYTES_PER_TOKEN_ID * len(self.prompt_token_ids or ())
            + (json_size(self.messages) + json_size(self.template.kwargs) if self.messages is not None else 0)
            + sum(len(p) if isinstance(p, str) else BYTES_PER_TOKEN_ID * len(p) for p in self.prompts or ())
        )


# -- shared parameters -------------------------------------------------------------------------
def _common(body: dict[str, Any], kind: str, max_tokens: int | None, logprobs: int | None) -> GenerationSpec:
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {typename(body)}")
    model = get_field(body, "model", lambda v: isinstance(v, str), "a string", None)
    refuse_unless_neutral(body, "suffix", None)
    for name, neutral in UNSUPPORTED_VLLM_FIELDS:
        refuse_unless_neutral(body, name, neutral)
    if kind == "chat":
        refuse_unless_neutral(body, "best_of", 1)
    n = get_int(body, "n", 1)
    best_of = get_int(body, "best_of", None)
    logit_bias = _logit_bias(body)
    structured_outputs, structured_param = parse_structured(body)
    stream = get_bool(body, "stream", False)
    if stream and best_of is not None and best_of > 1:  # the best are known only at the end (OpenAI's rule)
        raise bad("'best_of' cannot be used with 'stream': results cannot be streamed", "best_of")
    options = get_field(body, "stream_options", lambda v: isinstance(v, dict), "an object", None)
    if options is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = get_bool(options or {}, "include_usage", False)
    # vLLM's: every chunk carries the usage so far (with ``include_usage``, as vLLM's)
    continuous_usage = include_usage and get_bool(options or {}, "continuous_usage_stats", False)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list):
        raise bad(f"'stop' must be a string or an array of strings, got {typename(stop)}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or an array of strings", "stop")
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad(f"'stop' strings may be at most {MAX_STOP_STRING_CHARS} characters long", "stop")
    most = SamplingParams.MAX_STOP_TOKEN_IDS
    stop_token_ids = get_field(
        body,
        "stop_token_ids",
        lambda v: isinstance(v, list) and len(v) <= most and all_ints(v),
        f"an array of at most {most} integers",
        [],
    )
    sampling = SamplingParams(
        temperature=get_num(body, "temperature", 1.0),
        top_p=get_num(body, "top_p", 1.0),
        top_k=get_int(body, "top_k", 0),
        min_p=get_num(body, "min_p", 0.0),
        # None (chat's default, the rest of the context) is known once the prompt is: until then a
        # stand-in that no other field is checked against (``min_tokens``).
        max_tokens=max_tokens if max_tokens is not None else INT32_MAX,
        min_tokens=get_int(body, "min_tokens", 0),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=get_bool(body, "ignore_eos", False),
        seed=get_int(body, "seed", None),
        logprobs=logprobs,
        presence_penalty=get_num(body, "presence_penalty", 0.0),
        frequency_penalty=get_num(body, "frequency_penalty", 0.0),
        repetition_penalty=get_num(body, "repetition_penalty", 1.0),
        logit_bias=logit_bias,
        n=n,
        best_of=best_of,
        structured_outputs=structured_outputs,
        allowed_token_ids=parse_allowed_token_ids(body),
    )
    if sampling.top_k == -1:
        sampling.top_k = 0
    prompt_logprobs = get_int(body, "prompt_logprobs", None)
    if prompt_logprobs is not None and stream:  # (as vLLM: they would come with no chunk of the stream)
        raise bad("'prompt_logprobs' is not available when 'stream' is true", "prompt_logprobs")
    sampling.prompt_logprobs = prompt_logprobs  # its range checked with the rest
    try:
        sampling.validate()
    except ValueError as exc:
        message = str(exc)
        raise bad(message, message.split(" ", 1)[0]) from None
    sampling.stop = list(stop)  # (checked above, with the gateway's limits)
    sampling.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output", False)
    sampling.skip_special_tokens = get_bool(body, "skip_special_tokens", True)
    return GenerationSpec(
        kind=kind,
        model=model,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        add_special_tokens=_add_special_tokens(body, kind == "chat"),
        logprobs=logprobs,
        structured=StructuredRequest(structured_param) if structured_param else None,
        truncate_prompt_tokens=parse_truncate_prompt_tokens(body),
        return_tokens_as_token_ids=get_bool(body, "return_tokens_as_token_ids", False),
        bad_words=parse_bad_words(body, sampling),
        priority=parse_priority(body),
        cache_salt=parse_cache_salt(body),
        return_token_ids=get_bool(body, "return_token_ids", False),
        prompt_logprobs=prompt_logprobs,
    )


def _add_special_tokens(body: dict[str, Any], chat: bool) -> bool:
    """``add_special_tokens``, by default (vLLM's) true for a prompt and false for chat messages: a
    chat template already writes the special tokens it wants."""
    return get_bool(body, "add_special_tokens", not chat)


def _logit_bias(body: dict[str, Any]) -> dict[int, Any] | None:
    """``logit_bias`` with integer keys (JSON object keys are strings); its ids and values are
    range-checked by `SamplingParams.validate`, the ids against the vocabulary once it is known."""
    value = get_field(body, "logit_bias", lambda v: isinstance(v, dict), "an object mapping token ids to biases", None)
    if value is None:
        return None
    most = SamplingParams.MAX_LOGIT_BIAS
    if len(value) > most:
        raise bad(f"'logit_bias' may hold at most {most} token ids, got {len(value)}", "logit_bias")
    out: dict[int, Any] = {}
    for key, bias in value.items():
        # Decimal ASCII digits only (int() would also take " 7", "+7", "7_0" or other scripts' digits),
        # and few of them: no id has more.
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"'logit_bias' keys must be token ids (decimal integers), got {preview(key)}", "logit_bias")
        if not is_num(bias):
            raise bad(f"'logit_bias' values must be numbers, got {typename(bias)} {preview(bias)}", "logit_bias")
        out[int(key)] = bias
    return out or None


def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
    """The first of ``names`` given; each given one is checked."""
    values = [(name, get_int(body, name, None)) for name in names]
    for name, value in values:
        if value is not None and value < 1:
            raise bad(f"'{name}' must be at least 1, got {value}", name)
    return next((value for _, value in values if value is not None), None)


# -- endpoints ---------------------------------------------------------------------------------
def parse_completion(body: Any) -> GenerationSpec:
    """Validate a ``/v1/completions`` body."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {typename(body)}")
    logprobs = get_int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= SamplingParams.MAX_LOGPROBS:
        raise bad(f"'logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {logprobs}", "logprobs")
    max_tokens = _max_tokens(body, "max_tokens")
    spec = _common(body, "completion", 16 if max_tokens is None else max_tokens, logprobs)
    spec.echo = get_bool(body, "echo", False)
    if spec.echo and logprobs is not None:
        # the prompt's logprobs come with its echo (streamed too); the engine computes the larger top-k asked for
        spec.sampling.prompt_logprobs = max(logprobs, spec.prompt_logprobs or 0)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        spec.prompts = _prompt_list(prompt)
        return spec
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        spec.prompt = prompt
    elif isinstance(prompt, list) and prompt and is_int(prompt[0]):
        # Token ids. Every one is checked later, by `check_token_ids` off the event loop: a body
        # of megabytes holds millions of them.
        spec.prompt_token_ids = prompt
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a non-empty string or a non-empty array of token ids", "prompt")
    return spec


def _prompt_list(prompts: list[Any]) -> list[str | list[int]]:
    """Several prompts: non-empty strings or non-empty arrays of token ids (each id is checked
    later, off the event loop, by `check_token_ids`)."""
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"'prompt' may list at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    for i, item in enumerate(prompts):
        if not (isinstance(item, str) or isinstance(item, list)) or not item:
            raise bad(
                f"'prompt' must be a string, an array of token ids, or an array of non-empty strings or token-id "
                f"arrays; prompt[{i}] is {typename(item)}" + ("" if item is None else f" {preview(item)}"),
                "prompt",
            )
    return prompts


def parse_chat(body: Any, parsers: ChatParsers = ChatParsers()) -> GenerationSpec:
    """Validate a ``/v1/chat/completions`` body, for a gateway with ``parsers``."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {typename(body)}")
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None)
    if top is not None:
        if not want_logprobs:
            raise bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}", "top_logprobs")
    spec = _common(body, "chat", _max_tokens(body, "max_completion_tokens", "max_tokens"), (top or 0) if want_logprobs else None)
    for name, neutral in CHAT_TEMPLATE_FIELDS:
        refuse_unless_neutral(body, name, neutral)
    spec.echo = get_bool(body, "echo", False)
    spec.messages = parse_messages(body)
    spec.template = parse_template_options(body, spec.messages)
    spec.structured = parse_tools(body, spec.sampling, spec.structured.param if spec.structured else None, parsers.tools)
    if spec.structured is not None and spec.structured.tool_call is not None and spec.structured.tool_call.kind == "parsed":
        spec.sampling.skip_special_tokens = False  # a call's tags may be special tokens (vLLM does the same)
    spec.include_reasoning = get_bool(body, "include_reasoning", True)
    if spec.sampling.structured_outputs is None:  # (a grammar binds from the first token: no thinking)
        spec.reasoning_parser = parsers.reasoning
    return spec


@dataclass(slots=True)
class TokenizeSpec:
    """A validated ``/tokenize`` request, in vLLM's shapes: a ``prompt``, or chat ``messages``
    rendered by the chat template as the chat endpoint renders them."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    template: TemplateOptions
    return_token_strs: bool

    @property
    def param(self) -> str:
        """The field that holds the input, for errors about it."""
        return "prompt" if self.messages is None else "messages"

    def input_size(self) -> int:
        """About how many bytes the input is, to tell large inputs apart."""
        return len(self.prompt or "") + (json_size(self.messages) + json_size(self.template.kwargs) if self.messages else 0)


def parse_tokenize(body: Any) -> TokenizeSpec:
    """Validate a ``/tokenize`` body: ``{"prompt", "add_special_tokens"?}`` or ``{"messages",
    "add_generation_prompt"?, "add_special_tokens"?}``, each with ``model``? and ``return_token_strs``?."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {typename(body)}")
    model = get_field(body, "model", lambda v: isinstance(v, str), "a string", None)
    return_token_strs = get_bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad("give either 'prompt' or 'messages', not both", "prompt")
        for name, neutral in (*CHAT_TEMPLATE_FIELDS, ("tools", [])):
            refuse_unless_neutral(body, name, neutral)
        messages = parse_messages(body)
        template = parse_template_options(body, messages)
        return TokenizeSpec(model, None, messages, _add_special_tokens(body, True), template, return_token_strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad(
            "'prompt' (a string) or 'messages' is required"
            if prompt is None
            else f"'prompt' must be a string, got {typename(prompt)}",
            "prompt",
        )
    return TokenizeSpec(model, prompt, None, _add_special_tokens(body, False), TemplateOptions(), return_token_strs)


def parse_detokenize(body: Any) -> tuple[str | None, list[Any]]:
    """Validate a ``/detokenize`` body ``{"model"?, "tokens": [...]}``: its model and token ids
    (checked later, off the event loop, by `check_token_ids`: there may be many)."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {typename(body)}")
    model = get_field(body, "model", lambda v: isinstance(v, str), "a string", None)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad(
            "'tokens' (an array of token ids) is required"
            if tokens is None
            else f"'tokens' must be an array of token ids, got {typename(tokens)}",
            "tokens",
        )
    return model, tokens
