"""Prompt tokenization off the event loop, safe for prompts of megabytes.

`Tokenizers` loads the served model's tokenizer once; `tokenize` turns a request into prompt token
ids, checking the vocabulary and the context (`fit_context`) without ever materializing millions of ids;
`tokenize_only` and `detokenize` answer ``/tokenize`` and ``/detokenize`` the same way
(`gateway.openai.input_workers` runs the large ones off the event loop).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from common.generation_config import load_sampling_defaults
from common.protocol import EngineStatus
from common.sampling_params import INT32_MAX, SamplingParams
from common.service_cli import freeze_startup_heap
from gateway.http.errors import ApiError, bad
from gateway.openai.chat_messages import chat_text
from gateway.openai.input_workers import InputWorkers
from gateway.openai.json_input import LARGE_INPUT_BYTES, all_ints, preview, typename
from gateway.openai.schema import GenerationSpec, TokenizeSpec
from gateway.openai.structured import check_grammar
from gateway.output.reasoning_parsers import prompt_phase

# Prompts up to this size are prepared on the event loop itself (`tokenizes_inline`): a thread hop
# costs far more than their work: on a busy gateway the hop waits a whole turn of the loop and a
# GIL hand-over, a large share of time to first token for token-id prompts that need no tokenizer.
INLINE_INPUT_BYTES = 4 * 1024


def tokenizes_inline(spec: GenerationSpec, tokenizer: Any) -> bool:
    """Whether `tokenize` may run on the event loop for ``spec``: a small prompt (token ids, or text
    for a fast tokenizer's lock-free backend, see `encode_text`) without a grammar to compile or
    tools, earlier tool calls or template variables for the chat template to render (walking them
    costs more than their size says). Such a prompt takes well under a millisecond; waiting for a
    worker thread takes tens on a busy gateway. Bad words (up to 256 encodings) take the worker too."""
    if spec.input_size() > INLINE_INPUT_BYTES or spec.sampling.structured_outputs is not None or spec.bad_words:
        return False
    if spec.structured is not None and spec.structured.tools:
        return False
    if spec.messages is not None and (spec.template.kwargs or any("tool_calls" in m for m in spec.messages)):
        return False
    if spec.prompt_token_ids is not None:
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and backend.truncation is None and backend.padding is None


async def prepare_prompt(
    workers: InputWorkers, tokenizer: Any, lock: threading.Lock, spec: GenerationSpec, info: EngineStatus, inline: bool
) -> tuple[list[int], str | None, int]:
    """`tokenize` ``spec``: on the event loop when ``inline`` (`tokenizes_inline`, decided for the whole
    request), else on a worker thread (the large-input pool past `LARGE_INPUT_BYTES`)."""
    if inline:
        return tokenize(tokenizer, lock, spec, info)
    return await workers.run(spec.input_size() > LARGE_INPUT_BYTES, tokenize, tokenizer, lock, spec, info)


def _load_tokenizer(path: str) -> Any:
    # transformers is imported here, on a worker thread: the import alone takes seconds of
    # interpreter time, which on the event loop would stall every stream.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Tokenizers:
    """The tokenizer of the served model, loaded once (off the event loop), and the model's
    sampling defaults (`common.generation_config`) read beside it when ``generation_config`` is "auto"."""

    def __init__(self, path: str | None, generation_config: str = "auto") -> None:
        self.path = path
        self.generation_config = generation_config
        self.sampling_defaults: dict[str, float] = {}
        self.tokenizer: Any = None
        self.error: str | None = None  # why the last load failed
        self.call_lock = threading.Lock()  # see `encode_text`
        self._lock = asyncio.Lock()

    async def get(self, info: EngineStatus) -> Any:
        if self.tokenizer is None:
            async with self._lock:
                if self.tokenizer is None:
                    path = self.path or info.model_path
                    try:
                        if self.generation_config == "auto":
                            self.sampling_defaults = await asyncio.to_thread(load_sampling_defaults, path)
                        self.tokenizer = await asyncio.to_thread(_load_tokenizer, path)
                    except Exception as exc:
                        self.error = f"could not load the tokenizer from {path}: {exc}"
                        raise
                    self.error = None
                    freeze_startup_heap()  # transformers and the tokenizer: the bulk of the heap
        return self.tokenizer


def tokenize(tokenizer: Any, lock: threading.Lock, spec: GenerationSpec, info: EngineStatus) -> tuple[list[int], str | None, int]:
    """Prompt token ids, prompt text and ``max_tokens`` (`fit_context`) of a completion or chat
    request; a 400 for token ids outside the vocabulary or a prompt past the context.

    Runs in a worker thread (`InputWorkers`): a long prompt takes seconds to tokenize. A prompt of
    token ids has text only for ``echo`` (decoded here, once the ids are known to fit). A structured
    output's grammar is compiled here too (`check_grammar`): a large schema takes a while.
    """
    check_grammar(spec.sampling, spec.structured, tokenizer, lock, info.vocab_size)
    if spec.bad_words and spec.sampling.bad_words_token_ids is None:  # (once for a list of prompts)
        spec.sampling.bad_words_token_ids = bad_words_token_ids(tokenizer, lock, spec.bad_words)
    param = "messages" if spec.kind == "chat" else "prompt"
    text = spec.prompt
    if spec.kind == "chat":
        assert spec.messages is not None
        tools = spec.structured.tools if spec.structured is not None else None
        text = chat_text(tokenizer, spec.messages, spec.template, tools or None)
        if spec.reasoning_parser is not None:
            continued = spec.messages[-1]["content"] if spec.template.continue_final_message else None
            spec.reasoning_phase = prompt_phase(text, continued)
    ids: list[int] | None
    keep = keep_tokens(spec, info.max_model_len)
    if text is None:
        assert spec.prompt_token_ids is not None
        ids = spec.prompt_token_ids if keep is None else spec.prompt_token_ids[-keep:]
        max_tokens = fit_context(spec, len(ids), info.max_model_len)  # first: it need not look at every id
        check_token_ids(ids, info.vocab_size, param)
        return ids, (tokenizer.decode(ids) if spec.echo else None), max_tokens
    if keep is not None:
        ids, cut = encode_tail(tokenizer, lock, text, spec.add_special_tokens, keep)
        max_tokens = fit_context(spec, len(ids), info.max_model_len)
        check_token_ids(ids, info.vocab_size, param)
        return ids, (tokenizer.decode(ids) if cut else text), max_tokens  # (echo: what the model read)
    count, exact, ids = encode_text(tokenizer, lock, text, spec.add_special_tokens, info.max_model_len)
    max_tokens = fit_context(spec, count, info.max_model_len, at_least=not exact)
    assert ids is not None  # fit_context rejects every prompt longer than max_model_len
    check_token_ids(ids, info.vocab_size, param)
    return ids, text, max_tokens


def echo_text(spec: GenerationSpec, prompt_text: str | None, prompt_ids: list[int], tokenizer: Any) -> str | None:
    """What ``echo`` puts before the output: a completion's prompt as the model read it; a chat's
    last message, when it is the assistant's (vLLM's rule: the answer goes on from it, as with
    ``continue_final_message``), else nothing."""
    if not spec.echo:
        return None
    if spec.kind == "chat":
        assert spec.messages is not None
        last = spec.messages[-1]
        return last["content"] or None if last["role"] == "assistant" else None
    return prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids)


def tokenize_only(tokenizer: Any, lock: threading.Lock, spec: TokenizeSpec, info: EngineStatus) -> dict[str, Any]:
    """The body of a ``/tokenize`` answer (vLLM's: ``count``, ``max_model_len``, ``tokens``, and
    ``token_strs`` if asked for): the very tokens a completion or chat request would carry.

    For a worker thread (`InputWorkers`). An input longer than the context is a 400 that gives its
    count, rather than up to millions of ids (vLLM returns them): nothing that long can be served,
    and counting it costs a fraction of tokenizing it (`encode_text`).
    """
    text = spec.prompt if spec.messages is None else chat_text(tokenizer, spec.messages, spec.template)
    assert text is not None
    limit = info.max_model_len
    count, exact, ids = encode_text(tokenizer, lock, text, spec.add_special_tokens, limit)
    if ids is None:
        some = "" if exact else "at least "
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, '{spec.param}' holds {some}{count} tokens.",
            param=spec.param,
            code="context_length_exceeded",
        )
    out: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
    if spec.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(tokenizer: Any, ids: list[Any], info: EngineStatus) -> str:
    """The text of token ``ids`` (``/detokenize``: the tokenizer's own ``decode``, special tokens
    kept, as vLLM's); a 400 for ids outside the vocabulary or more than the context holds. For a
    worker thread: a decode holds the GIL for its whole length."""
    if len(ids) > info.max_model_len:
        raise ApiError(
            400, f"'tokens' may hold at most {info.max_model_len} token ids (the model's context), got {len(ids)}", param="tokens"
        )
    check_token_ids(ids, info.vocab_size, "tokens")
    return str(tokenizer.decode(ids))


# Freeing an encoding of millions of tokens holds the GIL for up to seconds, wherever it happens,
# so a text longer than this (which may have that many) is first counted in windows of this size;
# only a text that may fit the context is then encoded whole, for its exact tokens.
COUNT_WINDOW_CHARS = 1 << 16
# How many tokens more than its share a window counted on its own may give at a cut (a word or a
# special token cut in two): the windowed count is only trusted past this much per cut.
CUT_OVERCOUNT = 16


def encode_text(
    tokenizer: Any, lock: threading.Lock, text: str, add_special_tokens: bool, max_len: int
) -> tuple[int, bool, list[int] | None]:
    """``(count, exact, ids)``: the number of tokens of ``text`` (``exact``, or else a lower bound
    when it is surely past ``max_len``), and the tokens themselves unless they are past ``max_len``.

    A fast tokenizer's backend is called directly: its ``encode_batch`` releases the GIL while it
    works (``encode`` and the transformers wrapper around it hold it for seconds on a long
    prompt), the length is known before the ids become Python ints, and every encoding is freed
    here, in this worker thread, before an exception could carry it to the event loop. The
    transformers call mutates the backend's settings as it goes, which the backend refuses
    ("Already borrowed") while another thread is encoding: those calls take turns on ``lock``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # With truncation or padding configured in the backend, transformers' own handling applies.
    if backend is not None and backend.truncation is None and backend.padding is None:
        if len(text) > COUNT_WINDOW_CHARS:
            at_least = _count_past(backend, text, add_special_tokens, max_len)
            if at_least is not None:
                return at_least, False, None
        encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        count = len(encoding)
        return count, True, (encoding.ids if count <= max_len else None)
    with lock:
        ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return len(ids), True, (ids if len(ids) <= max_len else None)


def bad_words_token_ids(tokenizer: Any, lock: threading.Lock, words: list[str]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word as it would start the text, and as it
    would follow a space when that is another first token and as many tokens (a tokenizer that
    marks word starts has two spellings of a word); a 400 past vLLM's total of tokens."""
    out: list[list[int]] = []
    for word in words:
        bare = encode_text(tokenizer, lock, word.lstrip(), False, INT32_MAX)[2] or []
        spaced = encode_text(tokenizer, lock, " " + word.lstrip(), False, INT32_MAX)[2] or []
        if bare:  # (a word a normalizer erases has no tokens to ban)
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    most, total = SamplingParams.MAX_BAD_WORDS, SamplingParams.MAX_BAD_WORDS_TOKENS
    if len(out) > most or sum(len(w) for w in out) > total:
        raise bad(
            f"'bad_words' may come to at most {most} token sequences of {total} tokens in all (each word is "
            f"one or two: its spelling after a space); these come to {len(out)} of {sum(len(w) for w in out)}",
            "bad_words",
        )
    return out


async def resolve_bad_words(workers: InputWorkers, tokenizer: Any, lock: threading.Lock, spec: GenerationSpec) -> None:
    """The token sequences of a resumed stream's ``bad_words`` (its body parsed again; a new
    request's are made by `tokenize`), on a worker thread."""
    if spec.bad_words:
        spec.sampling.bad_words_token_ids = await workers.run(False, bad_words_token_ids, tokenizer, lock, spec.bad_words)


def keep_tokens(spec: GenerationSpec, max_model_len: int) -> int | None:
    """How many of the prompt's last tokens to keep (vLLM's ``truncate_prompt_tokens``; -1: the
    model's context); None: all of them. A 400 past the context, as vLLM's."""
    keep = spec.truncate_prompt_tokens
    if keep is None or keep == -1:
        return None if keep is None else max_model_len
    if keep > max_model_len:
        raise bad(
            f"'truncate_prompt_tokens' ({keep}) must not exceed the model's context ({max_model_len} tokens)",
            "truncate_prompt_tokens",
        )
    return keep


def encode_tail(tokenizer: Any, lock: threading.Lock, text: str, add_special_tokens: bool, keep: int) -> tuple[list[int], bool]:
    """The last ``keep`` tokens of ``text``, and whether any were cut. As transformers' truncation
    from the left: the text's tokens are cut, and the special tokens the tokenizer adds (a BOS)
    are kept and count towards ``keep``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        # (transformers' own truncation is not used: it would leave the backend truncating for
        # every later call, which `encode_text` runs without the lock)
        with lock:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            wrapped = list(tokenizer(text, add_special_tokens=True)["input_ids"]) if add_special_tokens else ids
        head, tail = _around(wrapped, ids)
    else:
        head = tail = []
        if add_special_tokens:  # where the special tokens go: around one token, wrapped
            probe = backend.encode_batch(["a"], add_special_tokens=False)[0]
            head, tail = _around(backend.post_process(probe, None, True).ids, probe.ids)
        ids = _tail_ids(backend, text, keep - len(head) - len(tail))
    room = keep - len(head) - len(tail)
    if len(ids) <= room:  # (`_tail_ids` gives more than ``room`` of a text it did not encode whole)
        return head + ids + tail, False
    return (head + ids[len(ids) - room :] + tail if room > 0 else (head + tail)[-keep:]), True


def _tail_ids(backend: Any, text: str, room: int) -> list[int]:
    """The tokens of ``text`` (without special tokens), or, of a text too long to encode whole (see
    `COUNT_WINDOW_CHARS`), more than ``room`` of its last ones: those of a window at its end,
    grown until it holds enough, the first `CUT_OVERCOUNT` dropped (the window's edge may cut a
    word). Inside a run of that many tokens with no break a pre-tokenizer splits at (a long word,
    a run of one character), the tokens after a cut may differ from the whole text's."""
    window = COUNT_WINDOW_CHARS
    while True:
        start = max(0, len(text) - window)
        ids: list[int] = backend.encode_batch([text[start:]], add_special_tokens=False)[0].ids
        if start == 0:
            return ids
        if len(ids) > max(room, 0) + CUT_OVERCOUNT:
            return ids[CUT_OVERCOUNT:]
        window *= 4


def _around(wrapped: list[int], ids: list[int]) -> tuple[list[int], list[int]]:
    """The special tokens before and after ``ids`` in ``wrapped`` (``ids`` with them added)."""
    at = next((i for i in range(len(wrapped) - len(ids) + 1) if wrapped[i : i + len(ids)] == ids), 0)
    return wrapped[:at], wrapped[at + len(ids) :]


def _count_past(backend: Any, text: str, add_special_tokens: bool, limit: int) -> int | None:
    """A lower bound on the number of tokens of ``text`` if that is surely over ``limit``, else None.

    One window at a time, on one core (a request must not take them all), each encoding freed
    before the next; counting stops once the limit is surely passed, so a prompt of megabytes
    costs a fraction of its full tokenization.
    """
    num_windows = -(-len(text) // COUNT_WINDOW_CHARS)
    slack = CUT_OVERCOUNT * (num_windows - 1)
    count = backend.num_special_tokens_to_add(False) if add_special_tokens else 0
    for start in range(0, len(text), COUNT_WINDOW_CHARS):
        window = text[start : start + COUNT_WINDOW_CHARS]
        count += len(backend.encode_batch([window], add_special_tokens=False)[0])
        if count - slack > limit:
            return count - slack
    return None


# -- after tokenization ------------------------------------------------------------------------
# Items per builtin call over a long list: a call holds the GIL until it returns, and between
# calls the event loop's thread can take it.
_CHUNK = 1 << 15


def check_token_ids(ids: list[Any], vocab_size: int, param: str) -> None:
    """A 400 unless every id is an integer in ``[0, vocab_size)``; for a worker thread."""
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        if not all_ints(chunk):
            wrong = next(v for v in chunk if type(v) is not int)
            raise bad(f"'{param}' token ids must be integers, got {typename(wrong)} {preview(wrong)}", param)
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
