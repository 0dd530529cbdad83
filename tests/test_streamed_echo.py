"""The streamed echo chunk's prompt logprobs, unit by unit: when `ResponseFormatter` sends the echo,
and how `gateway.http.completions` hands child 0's prompt logprobs to a sibling whose pieces came first.
(Through the real stack: tests/test_api_parallel.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.openai.schema import parse_completion
from gateway.output.generation import Piece
from gateway.output.responses import ResponseFormatter
from gateway.output.streaming import SharedPromptLogprobs

pytestmark = pytest.mark.unit

PROMPT = [5, 6, 7]
PROMPT_LPS: list[dict[int, float] | None] = [None, {6: -0.5, 9: -1.5}, {7: -0.25, 6: -2.0}]


class Tokens:
    """A stand-in tokenizer: token ``i`` reads ``<i>``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def formatter(index: int = 0, **body: Any) -> ResponseFormatter:
    spec = parse_completion({"prompt": PROMPT, "echo": True, "stream": True, **body})
    return ResponseFormatter(spec, "cmpl-1", "m", Tokens(), len(PROMPT), "<5><6><7>", index, PROMPT)


def piece(token: int, prompt_lps: list[dict[int, float] | None] | None = None) -> Piece:
    return Piece(f"<{token}>", [token], [{token: -1.0}], prompt_logprobs=prompt_lps)


def test_echo_waits_for_the_first_piece_and_carries_the_prompt_logprobs() -> None:
    fmt = formatter(logprobs=1)
    assert fmt.spec.sampling.prompt_logprobs == 1  # asked of the engine, streamed or not
    assert fmt.stream_start() == []
    echo, first = fmt.stream_piece(piece(8, PROMPT_LPS))
    assert echo["choices"][0]["text"] == "<5><6><7>"
    assert echo["choices"][0]["logprobs"] == {
        "tokens": ["<5>", "<6>", "<7>"],
        "token_logprobs": [None, -0.5, -0.25],
        "top_logprobs": [None, {"<6>": -0.5}, {"<7>": -0.25}],
        "text_offset": [0, 3, 6],
    }
    # The generated tokens' logprobs follow, offset past the echo, without the prompt's again.
    assert first["choices"][0]["logprobs"] == {
        "tokens": ["<8>"],
        "token_logprobs": [-1.0],
        "top_logprobs": [{"<8>": -1.0}],
        "text_offset": [9],
    }
    assert [c["choices"][0]["text"] for c in fmt.stream_piece(piece(9))] == ["<9>"]


def test_echo_without_logprobs_is_sent_at_once() -> None:
    fmt = formatter()
    assert fmt.spec.sampling.prompt_logprobs is None
    [echo] = fmt.stream_start()
    assert echo["choices"][0] == {"index": 0, "text": "<5><6><7>", "logprobs": None, "finish_reason": None, "stop_reason": None}
    assert [c["choices"][0]["text"] for c in fmt.stream_piece(piece(8))] == ["<8>"]


def test_a_sibling_ahead_of_child_0_waits_for_its_prompt_logprobs() -> None:
    formatters = [formatter(i, logprobs=0, n=2) for i in range(4)]  # two prompts, two children each
    shared = SharedPromptLogprobs(formatters, 2)
    assert shared.ready(1, piece(8)) == [] and shared.ready(1, piece(9)) == []  # held, in order
    assert shared.ready(3, piece(4)) == []  # the other prompt's sibling too
    released = shared.ready(0, piece(8, PROMPT_LPS))
    assert [(i, p.token_ids) for i, p in released] == [(0, [8]), (1, [8]), (1, [9])]
    assert released[1][1].prompt_logprobs == PROMPT_LPS and released[2][1].prompt_logprobs is None
    chunks = [c for i, p in released for c in formatters[i].stream_piece(p)]
    echoes = [c["choices"][0] for c in chunks if c["choices"][0]["text"] == "<5><6><7>"]
    assert [e["index"] for e in echoes] == [0, 1]
    assert echoes[0]["logprobs"] == echoes[1]["logprobs"] and echoes[0]["logprobs"]["token_logprobs"] == [None, -0.5, -0.25]
    # Once known, a sibling's pieces pass straight through; the other prompt waits for its own child 0.
    assert shared.ready(1, piece(10))[0][1].token_ids == [10]
    other_lps: list[dict[int, float] | None] = [None, {6: -3.0}, {7: -4.0}]
    (_, own), (_, sibling) = shared.ready(2, piece(4, other_lps))
    assert own.prompt_logprobs == sibling.prompt_logprobs == other_lps
    assert shared.ready(3, piece(5)) == [(3, piece(5))]  # only a choice's first piece gets them


def test_top_logprobs_carry_the_chosen_token_and_offsets_never_go_back() -> None:
    """Completions' ``top_logprobs`` hold the top ``logprobs`` and the token chosen there when it is
    not among them (OpenAI's and vLLM's rule). Offsets count token strings, and the completion's go
    on from the prompt's, never backwards, even when the echoed text leaves a special token out (a
    BOS)."""
    spec = parse_completion({"prompt": PROMPT, "echo": True, "logprobs": 1})
    fmt = ResponseFormatter(spec, "cmpl-1", "m", Tokens(), len(PROMPT), "<6><7>", 0, PROMPT)  # <5> is not echoed
    chosen = Piece("<8>", [8], [{8: -1.0, 3: -0.1}], finish_reason="length", prompt_logprobs=PROMPT_LPS)
    lp = fmt.full_response([chosen], 1)["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 3, 6, 9]
    assert lp["top_logprobs"] == [None, {"<6>": -0.5}, {"<7>": -0.25}, {"<3>": -0.1, "<8>": -1.0}]
    assert lp["token_logprobs"] == [None, -0.5, -0.25, -1.0]
