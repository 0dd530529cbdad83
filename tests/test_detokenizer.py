"""Incremental detokenization and stop strings, with the tiny checkpoint's real tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from gateway.output.detokenizer import REPLACEMENT, IncrementalDetokenizer
from gateway.output.stop import StopMatcher

pytestmark = pytest.mark.model


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


@pytest.mark.parametrize("clean_up", [False, True], ids=["decode-stream", "window"])
def test_sentencepiece_style_tokenizer_streams_its_spaces_and_bytes(clean_up: bool) -> None:
    """Llama-2 / Mistral tokenizers: Metaspace pieces whose leading space is stripped at the start
    of a string, and byte-fallback tokens (<0xE6>...) for characters outside the vocabulary. Spaces
    are kept and no character is split: deltas equal the full decode. A stray byte that turns a
    byte run into invalid UTF-8 changes text already streamed; the stream goes on after it. Both
    paths: the Rust `DecodeStream`, and (a tokenizer that cleans up spaces) the decoded window."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["hello world this is a test", "def f(x):\n    return x + 1", "the quick brown fox"] * 20
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = metaspace
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    # SentencePiece's layout: the specials, then the 256 byte tokens as ordinary pieces, then the rest.
    learned = json.loads(trained.to_str())["model"]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    pieces += [p for p, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=clean_up, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )

    assert (IncrementalDetokenizer(tokenizer)._stream is None) == clean_up

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = encode("hello world 日本")
    deltas = _stream(tokenizer, ids)
    assert deltas[:2] == ["hello", " world"] and all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == "hello world 日本"
    rng = random.Random(2)
    words = len(pieces) - 259  # the pieces after the specials and the bytes
    for _ in range(100):  # any sequence of pieces, specials among them
        ids = [rng.choice([0, 1, 2, *range(259, 259 + words)]) for _ in range(rng.randrange(1, 60))]
        for chunk in (1, 4):
            assert "".join(_stream(tokenizer, ids, chunk)) == tokenizer.decode(ids, skip_special_tokens=True)

    stray = [3 + 0x19, 3 + 0x97, 3 + 0xE6]  # "\x19", then bytes that make the run invalid
    ids = encode("the quick") + stray + encode(" brown fox is a test")
    for chunk in (1, 3):
        detok = IncrementalDetokenizer(tokenizer)
        streamed = "".join(detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
        full = tokenizer.decode(ids)
        assert detok.diverged and full == "the quick" + 3 * REPLACEMENT + " brown fox is a test"
        # "\x19" went out before the bytes after it made it U+FFFD; all the rest streams as it
        # comes (nothing is held back for good, or dropped at the end)
        assert streamed == "the quick\x19" + 2 * REPLACEMENT + " brown fox is a test" and detok.finish() == ""


class _Metrics:
    """What `Generation` reports to its request's metrics: the engine steps it counts (one
    inter-token interval each, after the first) and the tokens."""

    def __init__(self) -> None:
        self.steps = self.tokens = 0

    def on_event(self, event) -> None:  # type: ignore[no-untyped-def]
        self.steps += event.num_steps
        self.tokens += len(event.token_ids)

    def finish(self, reason: str) -> None:
        pass


class _Client:
    """What `Generation` asks of its engine client once submitted."""

    gateway_id = "g"

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release(self, request_id: str) -> None:
        pass


def _stopped_at(tokenizer, token_ids: list[int], steps_per_event: int) -> tuple[str, int, list[int], int, int]:  # type: ignore[no-untyped-def]
    """(text, completion tokens, tokens of the pieces, engine steps and tokens the metrics counted)
    of a request stopped by "stop", its tokens arriving ``steps_per_event`` engine steps at a time."""
    import asyncio

    from common.sampling_params import SamplingParams
    from gateway.engine.handle import EngineEvent, RequestHandle
    from gateway.output.generation import Generation, SequenceRequest

    async def run() -> tuple[str, int, list[int], int, int]:
        client, metrics = _Client(), _Metrics()
        gen = Generation(client, tokenizer, SequenceRequest("r", [1], SamplingParams(max_tokens=100, stop=["stop"])), metrics)  # type: ignore[arg-type]
        gen.handle = RequestHandle("r", [1], {})
        for i in range(0, len(token_ids), steps_per_event):
            chunk = token_ids[i : i + steps_per_event]
            gen.handle.events.put_nowait(EngineEvent(chunk, [None] * len(chunk), num_steps=len(chunk)))
        text, tokens = "", []
        async for piece in gen.pieces():
            text += piece.text
            tokens += piece.token_ids
        assert client.aborted == ["r"]  # the engine is told to stop generating
        return text, gen.num_completion_tokens, tokens, metrics.steps, metrics.tokens

    return asyncio.run(run())


def test_where_a_stop_string_ends_a_request_does_not_depend_on_merged_steps(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A gateway that falls behind reads several engine steps as one event; the stop string must
    end the request at the same token (same text, same `usage.completion_tokens`, and the same
    engine steps in the metrics: `vllm:inter_token_latency_seconds` counted one a step) either way."""
    token_ids = tokenizer.encode("one two three stop four five six seven", add_special_tokens=False)
    one_by_one = _stopped_at(tokenizer, token_ids, 1)
    assert one_by_one[0] == "one two three " and one_by_one[1] < len(token_ids)
    for merged in (2, 3, len(token_ids)):
        assert _stopped_at(tokenizer, token_ids, merged) == one_by_one, merged
