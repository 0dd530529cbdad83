"""Resumable streams with several choices, unit by unit: the event ids that count each choice's
events (`gateway.choice_stream.ChoiceCursor`) and the replay of one choice from the journal its
siblings share (`gateway.outputs.replay`). Through the real stack: tests/test_api_parallel.py,
tests/test_chaos.py."""

from __future__ import annotations

import pytest

from gateway.choice_stream import ChoiceCursor
from gateway.json_input import ApiError
from gateway.outputs import replay
from gateway.request_handle import RequestHandle, base_request_id
from tests.test_engine_client import SAMPLING, outputs, tokens_of


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
