"""The SSE events of a streamed response, of one choice or several, and their resumable ids.

The choices' chunks are interleaved as their tokens arrive, an order a resumed stream cannot
reproduce (it replays each choice's journaled outputs, then continues live). So the id of each
event says what the client has of *every* choice: ``c0.5-c1.3`` (choice 0: 5 events, choice 1:
3); the closing event (the usage chunk, or an error) adds ``-end``, ``[DONE]`` adds ``-done``. A
stream of one choice writes the same count alone, its closing events counted in it: ``1``,
``2``, ... (`ChoiceCursor.event_id`). A client sends the last id back verbatim
(``Last-Event-ID``, as any EventSource does), and the resumed stream skips, per choice, the
events it has: every choice's events are a pure function of its journaled outputs, so none is
lost or sent twice, whatever the interleaving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.http.errors import ApiError
from gateway.output.generation import Generation, Piece
from gateway.output.responses import ResponseFormatter, done_event, sse

logger = logging.getLogger("conveyor.gateway")

MAX_COUNT_DIGITS = 9


@dataclass(slots=True)
class ChoiceCursor:
    """What a client has of a stream: events per choice, and whether the closing one."""

    counts: list[int]
    closed: bool = False

    def event_id(self, tail: str = "") -> str:
        """The id of an event after which the client has this: ``tail`` "end" for the closing
        event, "done" for ``[DONE]``. One choice: the number of events, closing ones included."""
        if len(self.counts) == 1:
            return str(self.counts[0] + (tail == "end" or (tail == "done" and self.closed)) + (tail == "done"))
        return "-".join([*(f"c{i}.{n}" for i, n in enumerate(self.counts)), *([tail] if tail else [])])

    def has_closing(self, counts: list[int]) -> bool:
        """Whether the client has the closing event of a stream whose choices had ``counts`` events."""
        return self.counts[0] > counts[0] if len(self.counts) == 1 else self.closed

    @classmethod
    def parse(cls, last_event_id: str, num_choices: int) -> ChoiceCursor:
        """``Last-Event-ID`` of a stream of ``num_choices`` choices ("" or "0": nothing yet); 400 if not one."""
        if last_event_id in ("", "0"):
            return cls([0] * num_choices)
        if num_choices == 1:
            if not (last_event_id.isascii() and last_event_id.isdigit()) or len(last_event_id) > MAX_COUNT_DIGITS:
                raise ApiError(400, f"Last-Event-ID must be an event number, got {last_event_id[:20]!r}", param="Last-Event-ID")
            return cls([int(last_event_id)])
        parts = last_event_id.split("-")
        closed = parts[-1] in ("end", "done")
        counts = parts[:-1] if closed else parts
        out = cls([], closed)
        for i, part in enumerate(counts):
            prefix, _, n = part.partition(".")
            if prefix != f"c{i}" or not (n.isascii() and n.isdigit()) or len(n) > MAX_COUNT_DIGITS:
                break
            out.counts.append(int(n))
        if len(out.counts) != num_choices or len(counts) != num_choices:
            shown = last_event_id[:40]
            raise ApiError(
                400,
                f"Last-Event-ID must be an event id of this stream of {num_choices} choices "
                f"(c0.<events>-c1.<events>...), got {shown!r}",
                param="Last-Event-ID",
            )
        return out


async def stream_choices(
    gens: list[Generation],
    formatters: list[ResponseFormatter],
    envelope: ResponseFormatter,
    k: int,
    seen: ChoiceCursor | None = None,
) -> AsyncIterator[str]:
    """SSE events of all choices, interleaved as their pieces arrive; ``[DONE]`` after the last.
    ``k``: children per prompt (their choices' echo chunks share child 0's prompt logprobs);
    ``seen``: what the client has (a resumed stream), not sent again."""
    echoes = SharedPromptLogprobs(formatters, k)
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()
    have = seen or ChoiceCursor([0] * len(gens))
    cursor = ChoiceCursor(list(have.counts))
    counts = [0] * len(gens)

    def new(i: int) -> bool:
        """Choice ``i`` has one more event: does the client lack it (then it is in ``cursor``)?"""
        counts[i] += 1
        if counts[i] <= have.counts[i]:
            return False
        cursor.counts[i] = counts[i]
        return True

    def position() -> ChoiceCursor:
        """Where the stream's closing events stand: per choice, the most of what the client had and
        what was sent; one choice's ids are positions in its one sequence of events."""
        return cursor if len(counts) > 1 else ChoiceCursor(counts, cursor.closed)

    def closing(body: dict[str, Any]) -> str:
        """The closing event (sent unless the client has it); ``[DONE]``'s id counts it."""
        sent = "" if have.has_closing(counts) else sse(body, position().event_id("end"))
        cursor.closed = True
        return sent

    async def run(i: int) -> None:
        try:
            async for piece in gens[i].pieces():
                await queue.put((i, piece))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(run(i)) for i in range(len(gens))]
    # The last events leave with [DONE], in one write (`EventStreamResponse`): the last choice's
    # last piece, the closing event.
    tail = ""
    try:
        # The events that are ready together (a piece's chunks) are yielded as one item: one write.
        if start := "".join(
            sse(chunk, cursor.event_id()) for i, f in enumerate(formatters) for chunk in f.stream_start() if new(i)
        ):
            yield start
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                if not isinstance(item, ApiError):
                    logger.error("streaming %s failed", envelope.request_id, exc_info=item)
                    item = ApiError(500, "internal error; see the gateway log", "server_error")
                tail += closing(item.body())
                break
            events = "".join(
                sse(chunk, cursor.event_id())
                for j, piece in echoes.ready(i, item)
                for chunk in formatters[j].stream_piece(piece)
                if new(j)
            )
            if tail:  # not the last events after all
                yield tail
            tail = events if item.finish_reason is not None and remaining == 1 else ""
            if events and not tail:
                yield events
        else:
            if envelope.spec.include_usage:
                tail += closing(envelope.usage_chunk(sum(g.num_completion_tokens for g in gens)))
    except Exception:  # a bug here: the client gets an error event and [DONE], not a cut connection
        logger.exception("streaming %s failed", envelope.request_id)
        tail += closing(ApiError(500, "internal error; see the gateway log", "server_error").body())
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
    yield tail + done_event(position().event_id("done"))


class SharedPromptLogprobs:
    """Streams the choices of a prompt with one echo's logprobs: only child 0 computes them, so a
    sibling whose echo chunk is still to come holds its pieces until child 0's first piece."""

    def __init__(self, formatters: list[ResponseFormatter], k: int) -> None:
        self.formatters = formatters
        self.k = k
        self.known: dict[int, list[dict[int, float] | None] | None] = {}  # prompt -> its logprobs
        self.held: dict[int, list[tuple[int, Piece]]] = {}  # prompt -> siblings' pieces, in order
        self.shared: set[int] = set()  # choices given them

    def ready(self, i: int, piece: Piece) -> list[tuple[int, Piece]]:
        """The (choice, piece) pairs to format now, in order, given choice ``i``'s ``piece``."""
        prompt, child = divmod(i, self.k)
        if child == 0:
            if prompt in self.known:
                return [(i, piece)]
            self.known[prompt] = piece.prompt_logprobs
            return [(i, piece), *(self._share(j, p) for j, p in self.held.pop(prompt, []))]
        if prompt not in self.known and self.formatters[i].echo_pending:
            self.held.setdefault(prompt, []).append((i, piece))
            return []
        return [self._share(i, piece)]

    def _share(self, i: int, piece: Piece) -> tuple[int, Piece]:
        """Choice ``i``'s piece; its first, for the echo chunk, with the prompt's logprobs."""
        if i in self.shared or not self.formatters[i].echo_pending or piece.prompt_logprobs is not None:
            return i, piece
        self.shared.add(i)
        return i, dataclasses.replace(piece, prompt_logprobs=self.known[i // self.k])
