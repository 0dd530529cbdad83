"""`EventStreamResponse`: one write per item of the stream, and the item that ends with ``[DONE]``
ends the body in the same write; `stream_choices` of one choice: the events of a piece are one item, the last
piece's go with ``[DONE]``, and a resumed stream skips what its client has. (The events themselves,
through the real stack: test_services.py, test_api_parallel.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.http.errors import ApiError
from gateway.openai.schema import parse_completion
from gateway.output.generation import Piece
from gateway.output.responses import EventStreamResponse, ResponseFormatter, done_event, sse
from gateway.output.streaming import ChoiceCursor, stream_choices

pytestmark = pytest.mark.unit

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/"}


def sent(items: list[str], drained: list[str] | None = None) -> list[dict[str, Any]]:
    """The ASGI messages an `EventStreamResponse` of ``items`` sends; ``drained`` collects what the
    iterator produced, sent or not."""
    messages: list[dict[str, Any]] = []

    async def body() -> AsyncIterator[str]:
        for item in items:
            if drained is not None:
                drained.append(item)
            yield item

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # never: the client stays
        return {}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(EventStreamResponse(body(), media_type="text/event-stream")(SCOPE, receive, send))
    return messages


def test_the_last_events_and_the_end_of_the_body_leave_in_one_write() -> None:
    first = sse({"text": "a"}, 1)
    last = sse({"text": "b", "finish_reason": "length"}, 2) + sse({"usage": {}}, 3) + done_event(4)
    messages = sent([first, last])
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body", "http.response.body"]
    assert (messages[1]["body"], messages[1]["more_body"]) == (first.encode(), True)
    assert (messages[2]["body"], messages[2]["more_body"]) == (last.encode(), False)  # no empty write after it
    assert last.endswith("id: 4\ndata: [DONE]\n\n")


def test_nothing_is_sent_after_done_but_the_stream_is_drained() -> None:
    drained: list[str] = []
    messages = sent([done_event(1), sse({"late": True}, 2)], drained)
    assert [m.get("more_body") for m in messages] == [None, False]
    assert len(drained) == 2  # the iterator ran to its end (its clean-up ran)


def test_a_stream_without_done_still_ends_its_body() -> None:
    messages = sent([sse({"text": "a"}, 1)])
    assert [(m.get("body"), m.get("more_body")) for m in messages[1:]] == [(sse({"text": "a"}, 1).encode(), True), (b"", False)]


class Tokens:
    """A stand-in tokenizer: token ``i`` reads ``<i>``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


class Pieces:
    """A stand-in `Generation`: its pieces, then (optionally) an error."""

    def __init__(self, pieces: list[Piece], error: ApiError | None = None) -> None:
        self.items, self.error, self.num_completion_tokens = pieces, error, 0

    async def pieces(self) -> AsyncIterator[Piece]:
        for piece in self.items:
            self.num_completion_tokens += len(piece.token_ids)
            yield piece
        if self.error is not None:
            raise self.error


def items(gen: Pieces, skip_through: int = 0, **body: Any) -> list[str]:
    spec = parse_completion({"prompt": [5], "stream": True, **body})
    fmt = ResponseFormatter(spec, "cmpl-1", "m", Tokens(), 1, None, 0, [5])

    async def run() -> list[str]:
        seen = ChoiceCursor.parse(str(skip_through), 1)
        return [item async for item in stream_choices([gen], [fmt], fmt, 1, seen)]  # type: ignore[list-item]

    return asyncio.run(run())


def ids(item: str) -> list[str]:
    return [line[4:] for line in item.split("\n") if line.startswith("id: ")]


def test_a_pieces_events_are_one_item_and_the_last_go_with_done() -> None:
    gen = Pieces([Piece("<1>", [1]), Piece("<2>", [2]), Piece("<3>", [3], finish_reason="length")])
    out = items(gen, stream_options={"include_usage": True})
    assert [ids(item) for item in out] == [["1"], ["2"], ["3", "4", "5"]]  # text, text, text + usage + [DONE]
    assert out[-1].endswith("id: 5\ndata: [DONE]\n\n") and '"usage"' in out[-1]


def test_a_resumed_stream_skips_what_its_client_has_even_an_error() -> None:
    def gen() -> Pieces:
        return Pieces([Piece("<1>", [1])], ApiError(503, "engine failed", "server_error"))

    assert [ids(item) for item in items(gen())] == [["1"], ["2", "3"]]  # the error, then [DONE]
    assert [ids(item) for item in items(gen(), skip_through=1)] == [["2", "3"]]
    # A client that has the error event gets only the end: the error is not sent twice.
    assert items(gen(), skip_through=2) == [done_event(3)]
