"""Resumable streams with several choices, unit by unit: the event ids that count each choice's
events (`gateway.output.streaming.ChoiceCursor`) and the replay of one choice from the journal its
siblings share (`gateway.engine.outputs.replay`). Through the real stack: tests/test_api_parallel.py,
tests/test_chaos.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.engine.handle import RequestHandle, base_request_id
from gateway.engine.outputs import replay
from gateway.http.errors import ApiError
from gateway.output.streaming import ChoiceCursor
from tests.test_engine_client import SAMPLING, outputs, tokens_of

pytestmark = pytest.mark.unit


def test_event_ids_round_trip() -> None:
    cursor = ChoiceCursor([5, 0, 12])
    assert cursor.event_id() == "c0.5-c1.0-c2.12"
    assert ChoiceCursor.parse(cursor.event_id(), 3) == cursor
    assert cursor.event_id("end") == "c0.5-c1.0-c2.12-end"
    assert ChoiceCursor.parse("c0.5-c1.0-c2.12-end", 3) == ChoiceCursor([5, 0, 12], closed=True)
    assert ChoiceCursor.parse("c0.5-c1.0-c2.12-done", 3).closed
    for nothing_yet in ("", "0"):
        assert ChoiceCursor.parse(nothing_yet, 2) == ChoiceCursor([0, 0])


@pytest.mark.parametrize(
    "bad",
    [
        "7",
        "c0.5",
        "c0.5-c1.2-c2.1",
        "c1.5-c0.2",
        "c0.x-c1.2",
        "c0.-c1.2",
        "c0.5-c1.2-bye",
        "c0.1234567890-c1.0",
        "c0.5-c1.2-end-end",
    ],
)
def test_an_event_id_of_another_stream_is_a_400(bad: str) -> None:
    with pytest.raises(ApiError) as info:
        ChoiceCursor.parse(bad, 2)
    assert info.value.status == 400 and info.value.param == "Last-Event-ID"


def test_base_request_id() -> None:
    assert base_request_id("cmpl-1-0-1") == "cmpl-1-0-1"
    assert base_request_id("cmpl-1-0-1~2") == "cmpl-1-0-1"
    assert base_request_id("a~b-1234abcd") == "a~b-1234abcd"  # a client's id may hold "~"


def test_replay_takes_only_its_choice_from_a_shared_journal() -> None:
    """Siblings' entries interleave in one journal; an orphaned step's entry holds several of them."""
    journal = [
        outputs(("r-0-0", 0, [5, 6])),
        outputs(("r-0-1", 0, [7])),
        outputs(("r-0-1", 1, [8]), ("r-0-0~1", 2, [9])),  # a scheduler journals both (orphans), one a retry
        outputs(("r-0-0-x", 3, [1])),  # another request whose id merely starts alike
        outputs(("r-0-0~1", 3, [10], True, "length")),
    ]
    first = RequestHandle("r-0-0", [1], SAMPLING)
    events = replay(first, journal)
    assert tokens_of(events) == [5, 6, 9, 10] and events[-1].finished
    second = RequestHandle("r-0-1", [1], SAMPLING)
    events = replay(second, journal)
    assert tokens_of(events) == [7, 8] and not any(e.finished for e in events)


def test_continuous_usage_counts_each_pieces_own_tokens_with_several_choices() -> None:
    """With ``n`` > 1 the choices' pieces are queued as they come and formatted later (a resumed
    stream's journal arrives all at once): each chunk's usage is that of its piece, 1, 2, 3, 4 per
    choice, not the choice's count when the chunk happened to be formatted (4, 4, 4, 4)."""
    import asyncio
    import json

    from common.sampling_params import SamplingParams
    from gateway.openai.schema import GenerationSpec
    from gateway.output.generation import Piece
    from gateway.output.responses import ResponseFormatter
    from gateway.output.streaming import stream_choices

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "x"

    class Replayed:  # every event already there, as after a resume
        def __init__(self) -> None:
            self.num_completion_tokens = 0

        async def pieces(self) -> Any:
            for k in range(4):
                self.num_completion_tokens += 1
                yield Piece("x", [k], [None], "length" if k == 3 else None, completion_tokens=self.num_completion_tokens)

    spec = GenerationSpec("completion", None, SamplingParams(), 4, stream=True, include_usage=True, continuous_usage=True)
    formatters = [ResponseFormatter(spec, "r", "m", Tokenizer(), 3, None, i, [1, 2, 3]) for i in range(2)]
    envelope = ResponseFormatter(spec, "r", "m", Tokenizer(), 6, None)

    async def counts() -> dict[int, list[int]]:
        seen: dict[int, list[int]] = {0: [], 1: []}
        async for item in stream_choices([Replayed(), Replayed()], formatters, envelope, 2):  # type: ignore[list-item]
            for line in item.splitlines():
                if line.startswith("data: {") and (chunk := json.loads(line[6:]))["choices"]:
                    seen[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
        return seen

    assert asyncio.run(counts()) == {0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}
