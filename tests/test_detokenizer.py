"""Incremental detokenization and stop strings, with the tiny checkpoint's real tokenizer."""

from __future__ import annotations

import random

import pytest

from gateway.detokenizer import REPLACEMENT, IncrementalDetokenizer
from gateway.stop import StopMatcher


@pytest.fixture(scope="module")
def tokenizer(tiny_model):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model())


def _stream(tokenizer, ids: list[int], chunk: int = 1) -> list[str]:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas


def test_concatenated_deltas_equal_full_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    texts = ["héllo wörld — 日本語のテキスト 🎉🚀 done", "def f(x):\n    return x  # ñ", "  spaces   and\ttabs\n"]
    cases = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    # Random token sequences (what a random model emits): stray bytes, specials, anything.
    cases += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 80))] for _ in range(200)]
    for ids in cases:
        full = tokenizer.decode(ids, skip_special_tokens=True)
        for chunk in (1, 3):
            deltas = _stream(tokenizer, ids, chunk)
            assert "".join(deltas) == full
    # Nothing is held back once a character is complete: after each chunk, the streamed text is the
    # decode of the tokens so far whenever that decode ends on a whole character.
    for ids in cases[:3]:
        text = ""
        for k, d in enumerate(_stream(tokenizer, ids, 1), start=1):
            text += d
            so_far = tokenizer.decode(ids[:k], skip_special_tokens=True)
            if not so_far.endswith(REPLACEMENT):
                assert text == so_far, (k, text, so_far)


def test_multibyte_character_is_never_split(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("🎉日本", add_special_tokens=False)["input_ids"]
    assert len(ids) > 3  # byte-level pieces of multi-byte characters
    deltas = _stream(tokenizer, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == "🎉日本"


def test_stop_string_cut_before_and_never_partially_streamed() -> None:
    m = StopMatcher(["STOP"])
    out = [m.feed(t) for t in ["hello S", "T", "O", "x more ST", "OP tail"]]
    assert out == [("hello ", False), ("", False), ("", False), ("STOx more ", False), ("", True)]
    assert m.matched == "STOP" and m.feed("after") == ("", True)


def test_stop_string_included_and_earliest_wins() -> None:
    m = StopMatcher(["world", "lo w"], include_stop=True)
    assert m.feed("hello world") == ("hello w", True)
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == ("a", False)
    assert m.flush() == "\n"  # generation ended without the stop string: release the held text


def test_stop_matcher_matches_offline_truncation() -> None:
    rng = random.Random(1)
    alphabet = "ab\n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        m = StopMatcher(stops)
        pieces, pos, stopped = [], 0, False
        while pos < len(text) and not stopped:
            n = rng.randrange(1, 4)
            out, stopped = m.feed(text[pos : pos + n])
            pieces.append(out)
            pos += n
        if not stopped:
            pieces.append(m.flush())
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[: min(hits)] if hits else text
        assert "".join(pieces) == expected, (text, stops)
