"""Input hardening, unit by unit: the JSON body checks, the sampling bounds, and tokenization
(exact, counted in windows when huge, and its errors as 400s)."""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from common.protocol import EngineStatus
from common.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN, SamplingParams
from gateway.http.errors import ApiError
from gateway.openai.json_input import MAX_JSON_DEPTH, parse_json
from gateway.openai.schema import parse_chat, parse_completion
from gateway.openai.tokenization import (
    _CHUNK,
    COUNT_WINDOW_CHARS,
    INLINE_INPUT_BYTES,
    _count_past,
    check_token_ids,
    encode_tail,
    encode_text,
    tokenize,
    tokenizes_inline,
)

pytestmark = pytest.mark.model


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _rejects(data: bytes, *words: str, cooperative: bool = False) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_json(data, cooperative)
    err = info.value
    assert err.status == 400 and all(w in err.message for w in words), err.message
    json.dumps(err.body(), ensure_ascii=False).encode()  # the answer itself can always be sent
    return err


# -- the JSON body -------------------------------------------------------------------------------
def test_nesting_is_limited_however_deep_and_wherever_parsed() -> None:
    parse_json(_nested(MAX_JSON_DEPTH))  # at the limit: fine
    for depth in (MAX_JSON_DEPTH + 1, 3000, 100_000):  # past the parser's recursion limit too
        _rejects(_nested(depth), f"more than {MAX_JSON_DEPTH} levels")
        with ThreadPoolExecutor(1) as pool:  # large bodies are parsed in a worker thread
            with pytest.raises(ApiError):
                pool.submit(parse_json, _nested(depth), True).result()
    err = _rejects(b'{"a": 1, "deep": {"x": ' + _nested(MAX_JSON_DEPTH) + b"}}", "levels")
    assert err.param == "deep"


def test_every_string_must_be_valid_unicode() -> None:
    cases = {
        b'{"prompt": "a\\ud800"}': "prompt",
        b'{"messages": [{"role": "user", "content": [{"text": "\\udfff"}]}]}': "messages",
        b'{"stop": ["x", "\\udbff"]}': "stop",
        b'{"ok": 1, "\\ud800": 2}': None,  # a bad key: nothing to name
        b'["\\ud800"]': None,
        b'"\\ud800"': None,
        b'{"prompt": "\xed\xa0\x80"}': "prompt",  # UTF-8-encoded surrogate bytes decode to one too
    }
    for data, param in cases.items():
        assert _rejects(data, "not valid Unicode").param == param
    assert parse_json(b'{"p": "\\ud83d\\ude00 \\u00e9 \\u0000"}') == {"p": "\U0001f600 \u00e9 \x00"}
    with pytest.raises(ApiError, match="not valid JSON"):  # JSON over HTTP is UTF-8 (RFC 8259)
        parse_json('{"prompt": "hi"}'.encode("utf-16"))
    assert parse_json('{"prompt": "hi"}'.encode("utf-8-sig")) == {"prompt": "hi"}  # a BOM is ignored, as before


def test_not_json_and_huge_numbers_are_400s() -> None:
    for data in (
        b'{"t": NaN}',
        b'{"t": Infinity}',
        b'{"t": -Infinity}',
        b'{"t": 1',
        b"\xff",
        b"",
        b'{"seed": 1' + b"0" * 5000 + b"}",
    ):
        for cooperative in (False, True):
            assert _rejects(data, "not valid JSON", cooperative=cooperative).code == "invalid_json"


def test_cooperative_parse_gives_the_same_result() -> None:
    body = json.dumps(
        {"prompt": list(range(-5, 5000)), "t": 0.5, "big": 2**70, "s": ["x", {"y": [1.5e300, -0]}], "u": "caf\u00e9 \U0001f600"}
    ).encode()
    assert parse_json(body, True) == parse_json(body) == json.loads(body)


# -- OpenAI parameters ---------------------------------------------------------------------------
def test_sampling_bounds() -> None:
    SamplingParams(max_tokens=INT32_MAX, min_tokens=INT32_MAX, top_k=INT32_MAX, seed=INT64_MAX, stop_token_ids=[0, 5]).validate(
        vocab_size=6
    )
    SamplingParams(seed=INT64_MIN, stop_token_ids=[INT32_MAX]).validate()
    SamplingParams(stop_token_ids=list(range(SamplingParams.MAX_STOP_TOKEN_IDS))).validate(vocab_size=2**20)
    bad: list[tuple[str, Any, int | None]] = [
        ("max_tokens", INT32_MAX + 1, None),
        ("max_tokens", True, None),
        ("min_tokens", 2**64, None),
        ("top_k", INT32_MAX + 1, None),
        ("top_k", -2, None),
        ("seed", INT64_MAX + 1, None),
        ("seed", INT64_MIN - 1, None),
        ("seed", True, None),
        ("logprobs", 2**64, None),
        ("temperature", float("nan"), None),
        ("top_p", float("inf"), None),
        ("stop_token_ids", [6], 6),
        ("stop_token_ids", [INT32_MAX + 1], None),
        ("stop_token_ids", [-1], None),
        ("stop_token_ids", [True], None),
        ("stop_token_ids", [1.0], None),
        ("stop_token_ids", [1] * (SamplingParams.MAX_STOP_TOKEN_IDS + 1), None),
    ]
    for name, value, vocab_size in bad:
        params = SamplingParams(max_tokens=16 if name != "min_tokens" else INT32_MAX)
        setattr(params, name, value)
        with pytest.raises(ValueError) as info:
            params.validate(vocab_size)
        assert str(info.value).startswith(name), (name, value, str(info.value))
        assert len(str(info.value)) < 200
    SamplingParams(stop_token_ids=[6]).validate()  # the vocabulary is checked only when known


def test_long_token_id_lists_are_checked_in_chunks() -> None:
    ids = [1] * (3 * _CHUNK)
    check_token_ids(ids, 2, "prompt")
    for bad, word in ((2, "[0, 2)"), (-1, "non-negative"), (True, "integers"), ("1", "integers")):
        with pytest.raises(ApiError) as info:
            check_token_ids([*ids, bad], 2, "prompt")
        assert word in info.value.message and info.value.param == "prompt"


# -- tokenization --------------------------------------------------------------------------------
def _info(model: Any, max_model_len: int = 2048, vocab_size: int = 1024) -> EngineStatus:
    return EngineStatus("s0", "i0", "tiny", str(model), max_model_len, vocab_size, 16, 64, "e0", 1, 64, 0, 0, 0, 0, 0, 0.0)


@pytest.fixture(scope="module")
def tokenizers_to_test(tiny_model: Any) -> list[Any]:
    """The tiny checkpoints' byte-level BPE tokenizers, and a Unigram one with a normalizer that
    changes the text's length (NFKC, lowercase) and a Metaspace pre-tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    found = [AutoTokenizer.from_pretrained(tiny_model(arch)) for arch in ("llama", "qwen2")]
    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Caf\u00e9 \ufb01ne \u2460 \U0001f600 naive",
        "def f(x):\n    return x * 2\n",
    ] * 50
    unigram.train_from_iterator(
        corpus, trainers.UnigramTrainer(vocab_size=120, special_tokens=["<s>", "<unk>"], unk_token="<unk>")
    )
    unigram.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    found.append(PreTrainedTokenizerFast(tokenizer_object=unigram, bos_token="<s>", unk_token="<unk>"))
    return found


def _texts() -> list[str]:
    prose = "The quick brown fox jumps over the lazy dog; caf\u00e9 \ufb01ne \u2460 \U0001f600 <s> "
    edge = "x" * (COUNT_WINDOW_CHARS - 2) + "<s>" + " end"  # a special token cut by a window edge
    return [
        "hi",
        "<s>hello</s>",
        "\u00e9\u0301 \ud55c\uad6d\uc5b4 \U0001f600\U0001f600",
        prose * (COUNT_WINDOW_CHARS // len(prose) + 20),
        edge,
        " " * (COUNT_WINDOW_CHARS + 7),
        "x" * (2 * COUNT_WINDOW_CHARS + 3),
    ]


def test_encode_text_gives_what_transformers_gives(tokenizers_to_test: list[Any]) -> None:
    for tok in tokenizers_to_test:
        for text in _texts():
            for special in (True, False):
                expected = list(tok(text, add_special_tokens=special)["input_ids"])
                count, exact, ids = encode_text(tok, threading.Lock(), text, special, 10**7)
                assert exact and ids == expected and count == len(expected), (type(tok).__name__, text[:30])
                # One token too many: counted (to the end, or in windows as "at least") to the truth.
                count, exact, ids = encode_text(tok, threading.Lock(), text, special, len(expected) - 1)
                assert ids is None and count == len(expected)


def test_windowed_count_is_a_true_lower_bound(tokenizers_to_test: list[Any]) -> None:
    """`_count_past` says "over the limit" only when the prompt is, and then only by a number the
    prompt has at least; far over the limit, it says so."""
    for tok in tokenizers_to_test:
        backend = tok.backend_tokenizer
        for text in _texts():
            if len(text) <= COUNT_WINDOW_CHARS:
                continue
            true = len(backend.encode_batch([text])[0])
            for limit in (1, true // 4, true - 1, true):
                at_least = _count_past(backend, text, True, limit)
                assert at_least is None or limit < at_least <= true, (text[:20], true, limit, at_least)
            assert _count_past(backend, text, True, true // 8) is not None


def test_tokenize_answers_400s(tiny_model: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model())
    info = _info(tiny_model())
    err = pytest.raises(
        ApiError, tokenize, tok, threading.Lock(), parse_completion({"prompt": "hello world " * 20_000}), info
    ).value
    assert err.code == "context_length_exceeded" and "at least" in err.message and err.param == "prompt"
    err = pytest.raises(ApiError, tokenize, tok, threading.Lock(), parse_completion({"prompt": "hello " * 3000}), info).value
    assert "at least" not in err.message, "a prompt counted to the end gives its exact length"
    err = pytest.raises(ApiError, tokenize, tok, threading.Lock(), parse_completion({"prompt": [1, 2**64]}), info).value
    assert err.param == "prompt" and "[0, 1024)" in err.message
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    spec = parse_chat({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]})
    err = pytest.raises(ApiError, tokenize, tok, threading.Lock(), spec, info).value
    assert err.status == 400 and err.param == "messages" and "roles must alternate" in err.message


def test_echo_of_token_ids_is_decoded_with_the_tokenization(tiny_model: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model())
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    info = _info(tiny_model())
    _, text, max_tokens = tokenize(tok, threading.Lock(), parse_completion({"prompt": ids, "echo": True, "max_tokens": 3}), info)
    assert text == tok.decode(ids) and max_tokens == 3
    assert tokenize(tok, threading.Lock(), parse_completion({"prompt": ids}), info)[1] is None


def test_small_prompts_are_prepared_on_the_event_loop(tiny_model: Any) -> None:
    """Token ids and short texts skip the worker thread; a grammar to compile, a long prompt, or a
    tokenizer that needs the shared lock (truncation set in its backend) still take it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model())
    assert tokenizes_inline(parse_completion({"prompt": [5, 6, 7]}), tok)
    assert tokenizes_inline(parse_completion({"prompt": "hello world", "echo": True}), tok)
    assert tokenizes_inline(parse_chat({"messages": [{"role": "user", "content": "hi"}]}), tok)
    assert not tokenizes_inline(parse_completion({"prompt": "x" * (INLINE_INPUT_BYTES + 1)}), tok)
    assert not tokenizes_inline(parse_completion({"prompt": [5] * INLINE_INPUT_BYTES}), tok)
    assert not tokenizes_inline(parse_completion({"prompt": "hi", "structured_outputs": {"regex": "a+"}}), tok)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "none"}
    assert not tokenizes_inline(parse_chat(with_tools), tok)
    # An earlier turn's calls (their arguments are not counted) or long reasoning take the worker too.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert not tokenizes_inline(parse_chat({"messages": called}), tok)
    thought = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4", "reasoning": "x" * INLINE_INPUT_BYTES}]
    assert not tokenizes_inline(parse_chat({"messages": thought}), tok)
    tok.backend_tokenizer.enable_truncation(8)
    assert not tokenizes_inline(parse_completion({"prompt": "hello world"}), tok)
    assert tokenizes_inline(parse_completion({"prompt": [5, 6, 7]}), tok), "token ids need no tokenizer"


def test_truncated_prompts_keep_their_last_tokens_as_transformers_does(tokenizers_to_test: list[Any]) -> None:
    """vLLM's ``truncate_prompt_tokens``: transformers' truncation from the left, whose special
    tokens (a BOS) are kept and counted, on every tokenizer and text."""
    for tok in tokenizers_to_test:
        ref = copy.deepcopy(tok)  # its truncation stays set in its backend: its calls take the other path
        ref.truncation_side = "left"
        for text in _texts()[:4]:
            for special in (True, False):
                full = list(tok(text, add_special_tokens=special)["input_ids"])
                for keep in sorted({1, 2, 3, len(full) // 2, len(full) - 1, len(full), len(full) + 5} - {0}):
                    want = list(ref(text, add_special_tokens=special, truncation=True, max_length=keep)["input_ids"])
                    for path in (tok, ref):
                        got, cut = encode_tail(path, threading.Lock(), text, special, keep)
                        assert got == want and cut == (len(full) > keep), (path is ref, text[:20], special, keep)
        assert tok.backend_tokenizer.truncation is None  # untouched by the truncation
        # Past COUNT_WINDOW_CHARS only a window at the end is encoded: a run of spaces with no break
        # to cut at tokenizes with another alignment there, but still to the text's last tokens.
        spaces = _texts()[5]
        got, cut = encode_tail(tok, threading.Lock(), spaces, False, 17)
        assert cut and len(got) == 17 and set(got) <= set(tok(spaces, add_special_tokens=False)["input_ids"])


def test_truncate_prompt_tokens_in_requests(tiny_model: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model())
    lock, info = threading.Lock(), _info(tiny_model(), max_model_len=64)
    ids = list(range(10, 110))  # past the context: refused unless truncated
    with pytest.raises(ApiError, match="maximum context length"):
        tokenize(tok, lock, parse_completion({"prompt": ids, "max_tokens": 4}), info)
    got, text, max_tokens = tokenize(
        tok, lock, parse_completion({"prompt": ids, "truncate_prompt_tokens": 8, "echo": True}), info
    )
    assert got == ids[-8:] and text == tok.decode(ids[-8:]) and max_tokens == 16
    # -1: the model's context (vLLM's), which leaves no room for a completion here.
    err = pytest.raises(
        ApiError, tokenize, tok, lock, parse_completion({"prompt": ids, "truncate_prompt_tokens": -1}), info
    ).value
    assert err.code == "context_length_exceeded" and "64 in the prompt" in err.message
    words = "one two three four five six seven eight nine ten " * 20
    got, text, _ = tokenize(tok, lock, parse_completion({"prompt": words, "truncate_prompt_tokens": 6, "max_tokens": 2}), info)
    assert got == [tok.bos_token_id] + tok(words, add_special_tokens=False)["input_ids"][-5:]
    assert text == tok.decode(got)  # an echo shows what the model read
    short = tokenize(tok, lock, parse_completion({"prompt": "hi there", "truncate_prompt_tokens": 60, "echo": True}), info)
    assert short[0] == tok("hi there")["input_ids"] and short[1] == "hi there"
    chat = parse_chat({"messages": [{"role": "user", "content": words}], "truncate_prompt_tokens": 7, "max_tokens": 2})
    assert len(tokenize(tok, lock, chat, info)[0]) == 7
    for value, why in ((0, "must be -1"), (-2, "must be -1"), (65, "must not exceed the model's context (64")):
        spec_or_err = pytest.raises(
            ApiError, lambda v=value: tokenize(tok, lock, parse_completion({"prompt": ids, "truncate_prompt_tokens": v}), info)
        ).value
        assert spec_or_err.param == "truncate_prompt_tokens" and why in spec_or_err.message
