"""Stop strings: cut the output before the first stop string, never streaming part of one."""

from __future__ import annotations


def tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (a stop string, a parser's
    tag): the text a stream holds back until the next piece tells."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StopMatcher:
    """Filters streamed text; holds back any suffix that could be the start of a stop string.

    ``feed`` returns ``(text safe to emit, stopped)``. Once a stop string appears, the output ends
    right before it (or right after it with ``include_stop``) and later text is ignored.
    """

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self.held + text
        # Everything before `held` was free of stop strings, so searching `buffer` suffices.
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = buffer.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            self.stopped, self.matched, self.held = True, stop, ""
            return buffer[:i] + (stop if self.include_stop else ""), True
        hold = max(tag_prefix(buffer, stop) for stop in self.stops)
        self.held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """The generation ended without a stop string: release what was held back."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
