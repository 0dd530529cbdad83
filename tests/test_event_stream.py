"""`EventStreamResponse`: one write per item of the stream, and the item that ends with ``[DONE]``
ends the body in the same write. (The events themselves, through the real stack: test_services.py,
test_api_parallel.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from gateway.responses import EventStreamResponse, done_event, sse

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
