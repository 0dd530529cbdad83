"""Tool calls streamed in pieces, as vLLM streams them: a call's name (and id) once known, then
its arguments as they are generated, in ``delta.tool_calls`` entries by call index.

Under a named ``tool_choice`` the whole text is the arguments: each text delta is an argument
piece. Under ``"required"`` the text is a JSON array ``[{"name": ..., "parameters": {...}}, ...]``
(`gateway.openai.tool_grammar`): `CallScanner` reads it a character at a time, carrying its
state across pieces, so the name goes out once its string is closed and each call's arguments
are the text of its ``parameters`` value (whitespace outside strings dropped), piece by piece.
Under ``"auto"`` the hermes and llama3_json parsers' call objects (``{"name", "arguments"}``,
at the top level of their region), and mistral's array of them, go through the same scanner
(`gateway.output.tool_parsers`).
The non-streamed response reads its text with the same scanner, so the argument pieces of a
stream, however its text was split, join to the response's arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# One streamed event of a call: its index, its name (once, when first known) and an argument piece.
CallPiece = tuple[int, str | None, str]

_NAME_KEY = "name"
# Where a JSON string's plain run ends.
_STRING_STOP = re.compile(r'["\\]')
# What `CallScanner._argument_char` says of a character inside an arguments value.
_KEEP, _SKIP, _END = 0, 1, 2


@dataclass(slots=True)
class _Call:
    """What `CallScanner` knows of one call."""

    name: str | None = None
    name_sent: bool = False
    arguments: list[str] = field(default_factory=list)  # held until the name goes out
    argument_key: str | None = None  # the key whose value the arguments are (the first one met)


class CallScanner:
    """An incremental reader of call objects ``{"name": ..., <argument key>: {...}}`` whose
    members sit ``call_depth`` containers deep (2 in the "required" array, 1 for objects at the
    top level): `feed` returns the call pieces a text piece completes; `finish` those still held
    (arguments whose call's name never closed, ``{}`` for a call without arguments). Text outside
    the objects is passed over. Only the structure is read here: whether the whole is valid JSON
    is the caller's question."""

    def __init__(self, call_depth: int = 2, argument_keys: tuple[str, ...] = ("parameters",)) -> None:
        self.call_depth = call_depth
        self.argument_keys = argument_keys
        self.calls: list[_Call] = []
        self.depth = 0  # containers open
        self.in_string = False
        self.escaped = False
        self.key: str | None = None  # the call object's key whose value comes (or is being read)
        self.expect_key = False  # in a call object: the next string is a key
        self.token: list[str] = []  # a key's or the name's JSON string, as read so far
        self.reading: str | None = None  # "key", "name", "arguments" or None (a value skipped)

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        arguments: list[str] = []  # this piece's argument text of the current call
        at, end = 0, len(text)
        while at < end:
            if self.reading == "arguments" and self.in_string and not self.escaped:
                # Inside a string of the arguments, copy up to its next quote or backslash at once
                # (long string values are most of a large call).
                stop = _STRING_STOP.search(text, at)
                run_end = stop.start() if stop is not None else end
                if run_end > at:
                    arguments.append(text[at:run_end])
                    at = run_end
                    continue
            ch = text[at]
            at += 1
            if self.reading == "arguments" and (kind := self._argument_char(ch)) != _END:
                if kind == _KEEP:
                    arguments.append(ch)
                continue
            if arguments:
                self._send_arguments("".join(arguments), out)
                arguments.clear()
            self._structure(ch, out)
        if arguments:
            self._send_arguments("".join(arguments), out)
        return out

    def _argument_char(self, ch: str) -> int:
        """Whether ``ch`` ends the arguments value (a ``,`` or ``}`` of the call object), is
        whitespace between its tokens (dropped) or is kept; tracks strings and depth inside it."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return _KEEP
        if ch.isspace():
            return _SKIP
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            if self.depth == self.call_depth:  # the call object closes
                self.reading = None
                return _END
            self.depth -= 1
        elif ch == "," and self.depth == self.call_depth:
            self.reading = None
            return _END
        return _KEEP

    def _structure(self, ch: str, out: list[CallPiece]) -> None:
        """One character outside the arguments value."""
        if self.in_string:
            if self.reading in ("key", "name"):
                self.token.append(ch)
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self._string_done(out)
            return
        inside = self.depth == self.call_depth and bool(self.calls)
        if inside and self.key is not None and self.reading is None and not ch.isspace() and ch not in ":,}":
            if self.key in self.argument_keys and self.calls[-1].argument_key is None:  # the arguments begin
                self.reading = "arguments"
                self.calls[-1].argument_key = self.key
                self.key = None
                if self._argument_char(ch) == _KEEP:
                    self._send_arguments(ch, out)
                return
            if self.key == _NAME_KEY and ch == '"':
                self.reading, self.token, self.in_string, self.key = "name", [ch], True, None
                return
            self.key = None  # another key's value: skipped
        if ch == '"':
            if self.depth == 0:  # (text around the objects: a quote there opens no string)
                return
            self.in_string = True
            if inside and self.expect_key:
                self.reading, self.token, self.expect_key = "key", [ch], False
        elif ch in "[{":
            self.depth += 1
            if self.depth == self.call_depth and ch == "{":
                self.calls.append(_Call())
                self.expect_key = True
        elif ch in "]}":
            self.depth = max(self.depth - 1, 0)
        elif ch == "," and inside:
            self.expect_key = True

    def _string_done(self, out: list[CallPiece]) -> None:
        text, reading = "".join(self.token), self.reading
        self.reading, self.token = None, []
        try:
            value = json.loads(text)
        except ValueError:
            return
        if reading == "key":
            self.key = value
        elif reading == "name" and isinstance(value, str) and self.calls and self.calls[-1].name is None:
            call = self.calls[-1]
            call.name = value
            self._flush(len(self.calls) - 1, out)

    def _send_arguments(self, piece: str, out: list[CallPiece]) -> None:
        call = self.calls[-1]
        call.arguments.append(piece)
        if call.name is not None:
            self._flush(len(self.calls) - 1, out)

    def _flush(self, index: int, out: list[CallPiece]) -> None:
        """Call ``index``'s name (the first time) and its held arguments."""
        call = self.calls[index]
        held = "".join(call.arguments)
        call.arguments.clear()
        if not call.name_sent:
            call.name_sent = True
            out.append((index, call.name, held))
        elif held:
            out.append((index, None, held))

    def finish(self) -> list[CallPiece]:
        """What is still to go out once the text has ended."""
        out: list[CallPiece] = []
        for i, call in enumerate(self.calls):
            if call.name is None:
                continue
            if call.argument_key is None:
                call.arguments.append("{}")  # (as the response reads a call without arguments)
                call.argument_key = ""
            self._flush(i, out)
        return out


def join_pieces(pieces: list[CallPiece]) -> list[tuple[str, str]]:
    """The (name, arguments) calls that ``pieces`` make, in order of their index."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for index, name, piece in pieces:
        if name is not None:
            names[index] = name
        arguments.setdefault(index, []).append(piece)
    return [(names[i], "".join(arguments[i])) for i in sorted(names)]
