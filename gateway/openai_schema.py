"""OpenAI request parsing and validation, and the OpenAI error format.

Parsing is by hand rather than with pydantic models so every rejection carries OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}`` with a message that names the field
and what was wrong. Unknown fields are ignored (clients send many); fields whose non-default
values we cannot honour (``n > 1``, penalties, ``logit_bias``, tools...) are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered to the client in OpenAI's format."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
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


@dataclass(slots=True)
class GenerationSpec:
    """A validated completion or chat request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str | None
    sampling: SamplingParams
    max_tokens: int | None  # None: fill the context (chat default)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    echo: bool = False
    logprobs: int | None = None  # top-N per token; None: no logprobs


# -- typed getters -----------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typename(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null", float: "number",
            int: "integer"}.get(type(v), type(v).__name__)


def _get(body: dict[str, Any], name: str, check: Any, want: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(f"'{name}' must be {want}, got {_typename(value)} {str(value)[:40]!r}", name)
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
        raise bad(f"'{name}' = {str(value)[:40]} is not supported by this server (only {neutral!r})", name)


# -- shared parameters -------------------------------------------------------------------------
def _common(body: dict[str, Any], kind: str, max_tokens: int | None, logprobs: int | None) -> GenerationSpec:
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, got {_typename(body)}")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", None)
    if body.get("n") is not None and body.get("n") != 1:
        _int(body, "n", 1)
        raise bad("only n = 1 is supported", "n")
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("best_of", 1), ("logit_bias", {}), ("suffix", None)):
        _unsupported(body, name, neutral)
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
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad(f"'stop' must be a string or an array of strings, got {_typename(stop)}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty", "stop")
    stop_token_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                          "an array of integers", [])
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
    )
    if sampling.top_k == -1:
        sampling.top_k = 0
    try:
        sampling.validate()
    except ValueError as exc:
        message = str(exc)
        raise bad(message, message.split(" ", 1)[0]) from None
    return GenerationSpec(
        kind=kind, model=model, sampling=sampling, max_tokens=max_tokens, stream=stream,
        include_usage=include_usage, stop=list(stop),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        add_special_tokens=_bool(body, "add_special_tokens", kind == "completion"),
        logprobs=logprobs,
    )


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
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad("'prompt' token ids must be non-negative", "prompt")
        spec.prompt_token_ids = list(prompt)
    elif prompt is None:
        raise bad("'prompt' is required", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
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
    spec = _common(body, "chat", _max_tokens(body, "max_completion_tokens", "max_tokens"),
                   (top or 0) if want_logprobs else None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array", "messages")
    parsed: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object, got {_typename(message)}", "messages")
        role = message.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is supported
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
    spec.messages = parsed
    return spec
