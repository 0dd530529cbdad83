"""OpenAI request parsing and validation, and the OpenAI error format.

Parsing is by hand rather than with pydantic models so every rejection carries OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}`` with a message that names the field
and what was wrong. Unknown fields are ignored (clients send many); fields whose non-default
values we cannot honour (``n > 1``, ``best_of``, ``suffix``, tools...) are rejected.

No input gets past here as a 500 or as work that would slow other requests: the body must be
JSON (no ``NaN``), nested at most `MAX_JSON_DEPTH` levels, with every string valid Unicode;
integers are range-checked (`SamplingParams.validate`); lists are bounded, since parsing runs on
the event loop, except prompt token ids, which `check_token_ids` checks later in a worker thread.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from typing import Any

from common.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
# Stop strings are matched (and partial matches held back) on every streamed token; the cost of
# holding back grows with the square of a stop string's length.
MAX_STOP_STRING_CHARS = 256
# Deeper JSON is never a real request; the limit also keeps the parser far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Messages and content parts are checked one by one on the event loop, so their number is bounded.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096
# About how many bytes of a JSON body one token id takes, to size inputs given as ids.
BYTES_PER_TOKEN_ID = 4


class ApiError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# -- the body ----------------------------------------------------------------------------------
def parse_json(data: bytes, cooperative: bool = False) -> Any:
    """A request body as JSON, or a 400: not JSON (``NaN`` and ``Infinity`` are not JSON either),
    nested deeper than `MAX_JSON_DEPTH`, or holding a string that is not valid Unicode (a lone
    surrogate such as ``"\\ud800"``, which neither tokenizers nor UTF-8 encoders accept).

    ``cooperative``: for a worker thread parsing a large body. The C parser holds the GIL for the
    whole parse, which for a long array of numbers is long enough to stall the event loop; through
    a Python-level ``parse_int`` the interpreter can switch threads while it parses.
    """
    try:
        body = json.loads(data, parse_constant=_not_json, parse_int=_parse_int if cooperative else None)
    except RecursionError:  # far deeper than MAX_JSON_DEPTH
        raise _too_deep(None) from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    _check_tree(body)
    return body


def _parse_int(digits: str) -> int:
    return int(digits)  # Python code on purpose: see `parse_json`


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _too_deep(param: str | None) -> ApiError:
    return bad(f"request body is nested more than {MAX_JSON_DEPTH} levels deep", param, "invalid_json")


def _check_tree(body: Any) -> None:
    """Reject nesting past `MAX_JSON_DEPTH` and invalid strings; errors name the top-level field."""
    if isinstance(body, str):
        _check_text(body, None)
    if not isinstance(body, (dict, list)):
        return
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(where)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                name = key[:64] if where is None else where
                if isinstance(item, str):
                    _check_text(item, name)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, name))
        else:
            for item in value:
                if isinstance(item, str):
                    _check_text(item, where)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, where))


def _check_text(text: str, where: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # The message names the code point but never holds it: it could not be encoded either.
        raise bad(
            f"{f'{where!r}' if where else 'request body'} holds a string that is not valid Unicode "
            f"(lone surrogate \\u{ord(text[exc.start]):04x} at index {exc.start})",
            where,
            "invalid_string",
        ) from None


@dataclass(slots=True)
class GenerationSpec:
    """A validated completion or chat request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str | None
    sampling: SamplingParams
    max_tokens: int | None  # None: fill the context (chat default)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # checked with the model's vocabulary: `check_token_ids`
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    echo: bool = False
    logprobs: int | None = None  # top-N per token; None: no logprobs

    def input_size(self) -> int:
        """About how many bytes the prompt is, to tell large inputs apart."""
        return (
            len(self.prompt or "")
            + BYTES_PER_TOKEN_ID * len(self.prompt_token_ids or ())
            + sum(len(m["content"]) for m in self.messages or ())
        )


# -- typed getters -----------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _all_ints(values: list[Any]) -> bool:
    """Every item an integer (not a boolean); builtins, not a Python loop."""
    return set(map(type, values)) <= {int}


def _typename(v: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        type(None): "null",
        float: "number",
        int: "integer",
    }.get(type(v), type(v).__name__)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40
_REPR.maxlist = _REPR.maxdict = 4


def _preview(value: Any) -> str:
    """A short rendering of a value from the body, whatever its size, for an error message."""
    return _REPR.repr(value)


def _get(body: dict[str, Any], name: str, check: Any, want: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(f"'{name}' must be {want}, got {_typename(value)} {_preview(value)}", name)
    return value


def _int(body: dict[str, Any], name: str, default: Any) -> Any:
    return _get(body, name, _is_int, "an integer", default)


def _num(body: dict[str, Any], name: str, default: Any) -> Any:
    return _get(body, name, _is_num, "a number", default)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    return bool(_get(body, name, lambda v: isinstance(v, bool), "a boolean", default))


def _unsupported(body: dict[str, Any], name: str, neutral: Any) -> None:
    value = body.get(name)
    if value is not None and value != neutral:
        raise bad(f"'{name}' = {_preview(value)} is not supported by this server (only {neutral!r})", name)


# -- shared parameters -------------------------------------------------------------------------
def _common(body: dict[str, Any], kind: str, max_tokens: int | None, logprobs: int | None) -> GenerationSpec:
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {_typename(body)}")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", None)
    if body.get("n") is not None and body.get("n") != 1:
        _int(body, "n", 1)
        raise bad("only n = 1 is supported", "n")
    for name, neutral in (("best_of", 1), ("suffix", None)):
        _unsupported(body, name, neutral)
    logit_bias = _logit_bias(body)
    stream = _bool(body, "stream", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", None)
    if options is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list):
        raise bad(f"'stop' must be a string or an array of strings, got {_typename(stop)}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or an array of strings", "stop")
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad(f"'stop' strings may be at most {MAX_STOP_STRING_CHARS} characters long", "stop")
    most = SamplingParams.MAX_STOP_TOKEN_IDS
    stop_token_ids = _get(
        body,
        "stop_token_ids",
        lambda v: isinstance(v, list) and len(v) <= most and _all_ints(v),
        f"an array of at most {most} integers",
        [],
    )
    sampling = SamplingParams(
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),
        min_p=_num(body, "min_p", 0.0),
        max_tokens=max_tokens if max_tokens is not None else 1,
        min_tokens=_int(body, "min_tokens", 0),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        seed=_int(body, "seed", None),
        logprobs=logprobs,
        presence_penalty=_num(body, "presence_penalty", 0.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0),
        logit_bias=logit_bias,
    )
    if sampling.top_k == -1:
        sampling.top_k = 0
    try:
        sampling.validate()
    except ValueError as exc:
        message = str(exc)
        raise bad(message, message.split(" ", 1)[0]) from None
    return GenerationSpec(
        kind=kind,
        model=model,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        stop=list(stop),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        add_special_tokens=_add_special_tokens(body, kind == "chat"),
        logprobs=logprobs,
    )


def _add_special_tokens(body: dict[str, Any], chat: bool) -> bool:
    """``add_special_tokens``, by default (vLLM's) true for a prompt and false for chat messages: a
    chat template already writes the special tokens it wants."""
    return _bool(body, "add_special_tokens", not chat)


def _logit_bias(body: dict[str, Any]) -> dict[int, Any] | None:
    """``logit_bias`` with integer keys (JSON object keys are strings); its ids and values are
    range-checked by `SamplingParams.validate`, the ids against the vocabulary once it is known."""
    value = _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object mapping token ids to biases", None)
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
            raise bad(f"'logit_bias' keys must be token ids (decimal integers), got {_preview(key)}", "logit_bias")
        if not _is_num(bias):
            raise bad(f"'logit_bias' values must be numbers, got {_typename(bias)} {_preview(bias)}", "logit_bias")
        out[int(key)] = bias
    return out or None


def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = _int(body, name, None)
        if value is not None:
            if value < 1:
                raise bad(f"'{name}' must be at least 1, got {value}", name)
            return value
    return None


# -- endpoints ---------------------------------------------------------------------------------
def parse_completion(body: Any) -> GenerationSpec:
    """Validate a ``/v1/completions`` body."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {_typename(body)}")
    logprobs = _int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= SamplingParams.MAX_LOGPROBS:
        raise bad(f"'logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {logprobs}", "logprobs")
    max_tokens = _max_tokens(body, "max_tokens")
    spec = _common(body, "completion", 16 if max_tokens is None else max_tokens, logprobs)
    spec.echo = _bool(body, "echo", False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        spec.prompt = prompt
    elif isinstance(prompt, list) and prompt and _is_int(prompt[0]):
        # Token ids. Every one is checked later, by `check_token_ids` off the event loop: a body
        # of megabytes holds millions of them.
        spec.prompt_token_ids = prompt
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise bad("only one prompt per request is supported", "prompt")
    else:
        raise bad("'prompt' must be a non-empty string or a non-empty array of token ids", "prompt")
    return spec


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any) -> GenerationSpec:
    """Validate a ``/v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {_typename(body)}")
    for name in ("tools", "functions", "response_format", "tool_choice"):
        if body.get(name) not in (None, [], "none", {"type": "text"}):
            raise bad(f"'{name}' is not supported by this server", name)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None:
        if not want_logprobs:
            raise bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}", "top_logprobs")
    spec = _common(body, "chat", _max_tokens(body, "max_completion_tokens", "max_tokens"), (top or 0) if want_logprobs else None)
    spec.messages = _messages(body)
    return spec


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``messages`` as ``{"role", "content"}`` maps, content parts joined (text parts only)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"'messages' may hold at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    parsed: list[dict[str, str]] = []
    num_parts = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object, got {_typename(message)}", "messages")
        role = message.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {_preview(role)}", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            num_parts += len(content)
            if num_parts > MAX_CONTENT_PARTS:
                raise bad(f"messages may hold at most {MAX_CONTENT_PARTS} content parts in all", "messages")
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content parts must be text parts", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string, got {_typename(content)}", "messages")
        parsed.append({"role": role, "content": content})
    return parsed


@dataclass(slots=True)
class TokenizeSpec:
    """A validated ``/tokenize`` request, in vLLM's shapes: a ``prompt``, or chat ``messages``
    rendered by the chat template as the chat endpoint renders them."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool

    @property
    def param(self) -> str:
        """The field that holds the input, for errors about it."""
        return "prompt" if self.messages is None else "messages"

    def input_size(self) -> int:
        """About how many bytes the input is, to tell large inputs apart."""
        return len(self.prompt or "") + sum(len(m["content"]) for m in self.messages or ())


def parse_tokenize(body: Any) -> TokenizeSpec:
    """Validate a ``/tokenize`` body: ``{"prompt", "add_special_tokens"?}`` or ``{"messages",
    "add_generation_prompt"?, "add_special_tokens"?}``, each with ``model``? and ``return_token_strs``?."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {_typename(body)}")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", None)
    return_token_strs = _bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad("give either 'prompt' or 'messages', not both", "prompt")
        for name, neutral in (
            ("continue_final_message", False),
            ("chat_template", None),
            ("chat_template_kwargs", None),
            ("tools", None),
        ):
            _unsupported(body, name, neutral)
        return TokenizeSpec(
            model,
            None,
            _messages(body),
            _add_special_tokens(body, True),
            _bool(body, "add_generation_prompt", True),
            return_token_strs,
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad(
            "'prompt' (a string) or 'messages' is required"
            if prompt is None
            else f"'prompt' must be a string, got {_typename(prompt)}",
            "prompt",
        )
    return TokenizeSpec(model, prompt, None, _add_special_tokens(body, False), False, return_token_strs)


def parse_detokenize(body: Any) -> tuple[str | None, list[Any]]:
    """Validate a ``/detokenize`` body ``{"model"?, "tokens": [...]}``: its model and token ids
    (checked later, off the event loop, by `check_token_ids`: there may be many)."""
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {_typename(body)}")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", None)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad(
            "'tokens' (an array of token ids) is required"
            if tokens is None
            else f"'tokens' must be an array of token ids, got {_typename(tokens)}",
            "tokens",
        )
    return model, tokens


# -- the X-Request-Id header -------------------------------------------------------------------
# A client's request id becomes the response id and a prefix of the engine request id: it shows in
# logs, Redis key names and URLs (``/v1/streams/{id}``), so it is short and visible ASCII only.
MAX_REQUEST_ID_CHARS = 128


def parse_request_id(value: str | None) -> str | None:
    """The client's ``X-Request-Id`` (None when absent or blank); a 400 unless it is at most
    `MAX_REQUEST_ID_CHARS` visible ASCII characters (no spaces or control characters)."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise bad(
            f"X-Request-Id may be at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}",
            "X-Request-Id",
            "invalid_request_id",
        )
    if not all("!" <= c <= "~" for c in value):
        raise bad(
            f"X-Request-Id must be visible ASCII characters (no spaces or control characters), got {ascii(value)[:80]}",
            "X-Request-Id",
            "invalid_request_id",
        )
    return value


# -- after tokenization ------------------------------------------------------------------------
# Items per builtin call over a long list: a call holds the GIL until it returns, and between
# calls the event loop's thread can take it.
_CHUNK = 1 << 15


def check_token_ids(ids: list[Any], vocab_size: int, param: str) -> None:
    """A 400 unless every id is an integer in ``[0, vocab_size)``; for a worker thread."""
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        if not _all_ints(chunk):
            wrong = next(v for v in chunk if type(v) is not int)
            raise bad(f"'{param}' token ids must be integers, got {_typename(wrong)} {_preview(wrong)}", param)
        if (low := min(chunk)) < 0:
            raise bad(f"'{param}' token ids must be non-negative, got {low}", param)
        if (high := max(chunk)) >= vocab_size:
            raise bad(f"'{param}' token ids must be in [0, {vocab_size}) (the vocabulary), got {high}", param)


def fit_context(spec: GenerationSpec, num_prompt_tokens: int, max_model_len: int, at_least: bool = False) -> int:
    """The request's ``max_tokens`` (default: the rest of the context); a 400 naming both counts
    and the limit when prompt and completion do not fit. ``at_least``: the prompt was not
    counted to the end (it was far too long), and ``num_prompt_tokens`` is a lower bound."""
    n_prompt, limit = num_prompt_tokens, max_model_len
    max_tokens = spec.max_tokens if spec.max_tokens is not None else limit - n_prompt
    if n_prompt + max(max_tokens, 1) > limit:
        some = "at least " if at_least else ""
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested {some}"
            f"{n_prompt + max_tokens} tokens ({some}{n_prompt} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the prompt or max_tokens.",
            param="max_tokens" if n_prompt < limit else ("messages" if spec.kind == "chat" else "prompt"),
            code="context_length_exceeded",
        )
    return max_tokens
