"""Tool-call parsers for ``tool_choice: "auto"``: free-form model output -> OpenAI ``tool_calls``.

vLLM's ``--enable-auto-tool-choice --tool-call-parser NAME``: the model writes its calls in its own
format, which the chat template taught it, and the gateway finds them in the text. ``hermes``
(Qwen2.5, Qwen3, Hermes 2/3, and most models fine-tuned for tools) writes each call as a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; ``llama3_json``
(Llama 3.1-3.3) writes the whole answer as one such object (``"parameters"`` for the arguments),
or several joined by ``;``, optionally after ``<|python_tag|>``; ``mistral`` (Mistral's instruct
models) writes its calls after ``[TOOL_CALLS]``; ``pythonic`` (Llama 3.2 and 4) a Python list of
calls; ``qwen3_coder`` (Qwen3-Coder) XML whose values the tools' schemas type.

The content is the text before the first call. A response whose calls do not all parse (bad JSON,
no name, arguments that are not an object, a call cut short by ``max_tokens``) has none: its whole
text is the content, as in vLLM. Streamed, text before the first call goes out as it comes (minus
what may be the start of a call's tag, held until the next piece tells). From the tag on, hermes
and llama3_json stream each call as vLLM does: its name (and id) once known, then its arguments
in pieces (`gateway.output.call_deltas`); their arguments are the model's JSON text with the
whitespace between tokens dropped, in a response too, so the pieces join to the response's. The
other parsers' calls come whole in the final chunk. A stream and a response of the same tokens
agree, a resumed stream included.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.output.call_deltas import CallPiece, CallScanner, join_pieces
from gateway.output.stop import tag_prefix

# One call: the function's name and its arguments as a JSON string.
Call = tuple[str, str]
# The request's tools' parameter schemas, by function name.
Schemas = dict[str, dict[str, Any]]
# Where models put the arguments: Hermes' key, Llama's. Either is read (a call whose arguments
# were under the other key ran with none); a model's own key first.
ARGUMENT_KEYS = ("arguments", "parameters")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# NaN and Infinity, which Python's json reads, are no JSON a client could parse.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def arguments_json(arguments: Any) -> str | None:
    """``arguments`` as the JSON string a call carries; None when it cannot be one: nested past
    the recursion limit, a number past float's range, or a lone surrogate (``"\\ud800"`` reads
    as a string no UTF-8 response can hold)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        text.encode()
    except (ValueError, TypeError, RecursionError):  # (UnicodeEncodeError is a ValueError; a set: TypeError)
        return None
    return text


def _call(value: Any, keys: tuple[str, ...]) -> Call | None:
    """``value`` as a call, if it is an object with a name and object arguments (none: {})."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[k] for k in keys if k in value), {})
    text = arguments_json(arguments) if isinstance(arguments, dict) else None
    if text is None or arguments_json(value["name"]) is None:
        return None
    return value["name"], text


def _loads(text: str) -> Any:
    try:  # nested past the interpreter's recursion limit: no call either
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True, slots=True)
class HermesParser:
    """Calls as JSON objects between ``<tool_call>`` and ``</tool_call>``, anywhere in the text."""

    name: str = "hermes"
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    id_length: int = 0  # (call ids of OpenAI's shape)
    argument_keys: tuple[str, ...] = ARGUMENT_KEYS  # its calls are JSON objects: streamed in pieces

    def find(self, text: str, fresh: bool) -> int:
        """Where the first call starts in ``text`` (``fresh``: the output's beginning); -1: nowhere (yet)."""
        return text.find(self.start)

    def undecided(self, text: str, fresh: bool) -> int:
        """How many characters at the end of ``text`` (which holds no call) may begin one."""
        return tag_prefix(text, self.start)

    def parse(self, region: str, stopped: bool, schemas: Schemas | None = None) -> list[Call] | None:
        """The calls in ``region`` (the text from the first tag on); None unless all parse. The last
        call may lack its end tag only when the model stopped there (EOS): cut by the length
        limit, it may be incomplete JSON that happens to parse."""
        calls: list[Call] = []
        at = 0
        while (begin := region.find(self.start, at)) >= 0:
            body_at = begin + len(self.start)
            close = region.find(self.end, body_at)
            if close < 0 and not stopped:
                return None
            call = _call(_loads(region[body_at : len(region) if close < 0 else close].strip()), self.argument_keys)
            if call is None:
                return None
            calls.append(call)
            if close < 0:
                break
            at = close + len(self.end)
        return calls or None


@dataclass(frozen=True, slots=True)
class Llama3JsonParser:
    """The whole answer is the calls: ``{"name": ..., "parameters": {...}}`` objects joined by ``;``,
    optionally after ``<|python_tag|>`` (kept in the text: tokenizers mark it special)."""

    name: str = "llama3_json"
    python_tag: str = "<|python_tag|>"
    id_length: int = 0
    argument_keys: tuple[str, ...] = ARGUMENT_KEYS[::-1]

    def find(self, text: str, fresh: bool) -> int:
        head = text.lstrip()
        return 0 if fresh and (head.startswith("{") or head.startswith(self.python_tag)) else -1

    def undecided(self, text: str, fresh: bool) -> int:
        head = text.lstrip()  # (an answer yet to begin, or that begins with the tag, is still open)
        return len(text) if fresh and (not head or self.python_tag.startswith(head)) else 0

    def parse(self, region: str, stopped: bool, schemas: Schemas | None = None) -> list[Call] | None:
        if not stopped:
            return None
        body = region.lstrip()
        body = body[len(self.python_tag) :] if body.startswith(self.python_tag) else body
        calls = []
        at, end = 0, len(body)
        while True:
            while at < end and body[at].isspace():
                at += 1
            try:
                value, at = _DECODER.raw_decode(body, at)
            except (ValueError, RecursionError):
                return None
            call = _call(value, self.argument_keys)
            if call is None:
                return None
            calls.append(call)
            while at < end and body[at].isspace():
                at += 1
            if at == end:
                return calls
            if body[at] != ";":
                return None
            at += 1


@dataclass(frozen=True, slots=True)
class MistralParser:
    """Calls after ``[TOOL_CALLS]`` to the end: a JSON array of ``{"name", "arguments"}`` (Mistral's
    tokenizers before v11), or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (v11 and later).
    Its call ids are 9 letters and digits: Mistral's chat templates refuse others in a later turn."""

    name: str = "mistral"
    start: str = "[TOOL_CALLS]"
    args: str = "[ARGS]"
    id_length: int = 9
    argument_keys: tuple[str, ...] = ()  # (calls come whole at the end)

    def find(self, text: str, fresh: bool) -> int:
        return text.find(self.start)

    def undecided(self, text: str, fresh: bool) -> int:
        return tag_prefix(text, self.start)

    def parse(self, region: str, stopped: bool, schemas: Schemas | None = None) -> list[Call] | None:
        if not stopped:  # (no end tag: only the model's stop says the last call is whole)
            return None
        body = region[len(self.start) :].strip()
        if body.startswith("["):
            value = _loads(body)
            if not isinstance(value, list) or not value:
                return None
            calls = [_call(v, ARGUMENT_KEYS) for v in value]
        else:
            calls = []
            for part in region.split(self.start)[1:]:
                name, found, arguments = part.partition(self.args)
                name = name.partition("[CALL_ID]")[0]  # (v11 chat turns put an id there; a model may echo it)
                value = _loads(arguments.strip())
                calls.append(_call({"name": name.strip(), "arguments": value}, ARGUMENT_KEYS) if found and name.strip() else None)
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]


@dataclass(frozen=True, slots=True)
class PythonicParser:
    """The whole answer is a Python list of calls, ``[f(a=1), g(b="x")]`` (Llama 3.2 and 4, and
    models tuned on their format), maybe between ``<|python_start|>`` and ``<|python_end|>``.
    Read with `ast` (never run): keyword arguments of literal values only."""

    name: str = "pythonic"
    tags: tuple[str, str] = ("<|python_start|>", "<|python_end|>")
    id_length: int = 0
    argument_keys: tuple[str, ...] = ()

    def find(self, text: str, fresh: bool) -> int:
        head = text.lstrip()
        return 0 if fresh and (head.startswith("[") or head.startswith(self.tags[0])) else -1

    def undecided(self, text: str, fresh: bool) -> int:
        head = text.lstrip()
        return len(text) if fresh and (not head or self.tags[0].startswith(head)) else 0

    def parse(self, region: str, stopped: bool, schemas: Schemas | None = None) -> list[Call] | None:
        if not stopped:
            return None
        body = region.strip().removeprefix(self.tags[0]).removesuffix(self.tags[1]).strip()
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            found: list[Call | None] = []
            for node in tree.elts:
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                    return None
                if any(k.arg is None for k in node.keywords):  # (``**kwargs``)
                    return None
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                found.append(_call({"name": node.func.id, "arguments": arguments}, ARGUMENT_KEYS))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # (not literals, or nested too deep)
            return None
        return None if any(c is None for c in found) else [c for c in found if c is not None]


# (A name stops at "<" too, so a run of "<function=" is read in linear time, not quadratic.)
_FUNCTION = re.compile(r"<function=([^>\n<]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n<]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Qwen3CoderParser:
    """Qwen3-Coder's XML calls: ``<tool_call><function=NAME><parameter=P>value</parameter>...
    </function></tool_call>``, or the functions without the ``<tool_call>`` around them (as
    vLLM's reads them too). A value is text, typed by its parameter's schema in the request's tools
    (`_typed`)."""

    name: str = "qwen3_coder"
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    bare: str = "<function="
    id_length: int = 0
    argument_keys: tuple[str, ...] = ()

    def find(self, text: str, fresh: bool) -> int:
        found = [at for at in (text.find(self.start), text.find(self.bare)) if at >= 0]
        return min(found) if found else -1

    def undecided(self, text: str, fresh: bool) -> int:
        return max(tag_prefix(text, self.start), tag_prefix(text, self.bare))

    def parse(self, region: str, stopped: bool, schemas: Schemas | None = None) -> list[Call] | None:
        calls: list[Call] = []
        if region.startswith(self.start):
            blocks = [(body, bool(closed)) for body, closed, _ in (b.partition(self.end) for b in region.split(self.start)[1:])]
        else:  # bare functions: whole only when the model stopped after them
            blocks = [(region, stopped)]
        for body, closed in blocks:
            if not closed and not stopped:  # (cut by the length limit: maybe a value cut short)
                return None
            functions = list(_FUNCTION.finditer(body))  # (a block may hold several)
            if not functions:
                return None
            for function in functions:
                name = function.group(1).strip()
                properties = ((schemas or {}).get(name) or {}).get("properties")
                properties = properties if isinstance(properties, dict) else {}
                arguments = {
                    key.strip(): _typed(value.removeprefix("\n").removesuffix("\n"), properties.get(key.strip()))
                    for key, value in _PARAMETER.findall(function.group(2))
                }
                call = _call({"name": name, "arguments": arguments}, ARGUMENT_KEYS) if name else None
                if call is None:
                    return None
                calls.append(call)
        return calls or None


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows: its ``type`` (a name or a list of them) and
    those of its ``anyOf``/``oneOf`` branches (Pydantic's ``Optional[int]``)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            kinds += [k for branch in branches for k in _types(branch)]
    return kinds


# Whether a read JSON value is of a schema type (a number must be finite: JSON has no infinity).
_FITS: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as a type its schema allows: ``null`` where null is, else
    the text itself where a string is (or no type is known), else the first type the text reads
    as (booleans as ``true``/``false`` in any case); the text when it reads as none of them."""
    kinds, text = _types(schema), value.strip()
    if "null" in kinds and text == "null":
        return None
    if not kinds or "string" in kinds or not text:
        return value
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        read = _DECODER.decode(text)
    except (ValueError, RecursionError):
        return value
    return read if any(_FITS.get(kind, lambda v: False)(read) for kind in kinds) else value


ToolCallParser = HermesParser | Llama3JsonParser | MistralParser | PythonicParser | Qwen3CoderParser
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser(), Qwen3CoderParser())
}


def split_calls(
    parser: ToolCallParser, text: str, stopped: bool, schemas: Schemas | None = None
) -> tuple[str, list[Call] | None]:
    """``text`` as (content, calls): the calls and the text before them, or (``text``, None) when
    it makes none or not all of them parse. ``schemas``: the request's tools' parameter schemas
    (by name), for a format whose values are text (qwen3_coder)."""
    at = parser.find(text, True)
    if at < 0:
        return text, None
    calls = parse_region(parser, text[at:], stopped, schemas)
    return (text[:at], calls) if calls else (text, None)


def parse_region(parser: ToolCallParser, region: str, stopped: bool, schemas: Schemas | None = None) -> list[Call] | None:
    """The calls of ``region`` (the text from the first call on), None unless all parse; a parser
    that streams its calls gives each call's arguments as `CallScanner` reads them (the model's
    text, whitespace between tokens dropped), which the streamed pieces join to."""
    calls = parser.parse(region, stopped, schemas)
    if not calls or not parser.argument_keys:
        return calls
    scanner = CallScanner(1, parser.argument_keys)
    scanned = join_pieces([*scanner.feed(region), *scanner.finish()])
    if len(scanned) != len(calls):
        return calls
    # (the scanner takes the first argument key it meets, the parser its own first: an object
    # with both, or stray JSON between calls, keeps the parser's reading)
    return [
        (name, raw) if raw_name == name and _loads(raw) == _loads(arguments) else (name, arguments)
        for (name, arguments), (raw_name, raw) in zip(calls, scanned)
    ]


class CallStream:
    """One streamed choice's text through a parser: `feed` returns the content that can go out now,
    `pieces` the call pieces it completed (a parser with ``argument_keys``); `finish` the rest
    of the content and the calls once the output has ended, and `last_pieces` what of them is
    still to go out."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.held = ""  # text not sent: an undecided tail
        self.calls: list[str] = []  # everything from the first call on (joined once at the end: joining per piece is quadratic)
        self.in_calls = False
        self.fresh = True  # no content sent yet
        self.scanner = CallScanner(1, parser.argument_keys) if parser.argument_keys else None
        self.new: list[CallPiece] = []  # pieces not yet taken
        self.sent: dict[int, str] = {}  # call index -> its arguments sent (its name went out)

    def _scan(self, text: str) -> None:
        if self.scanner is not None:
            self.new += self.scanner.feed(text)

    def pieces(self) -> list[CallPiece]:
        """The call pieces completed since the last call (each noted as sent)."""
        out, self.new = self.new, []
        for index, _name, arguments in out:
            self.sent[index] = self.sent.get(index, "") + arguments
        return out

    def last_pieces(self, calls: list[Call]) -> list[CallPiece]:
        """What of the final ``calls`` has not gone out: whole calls, or the rest of the arguments
        of those already begun."""
        out: list[CallPiece] = []
        for index, (name, arguments) in enumerate(calls):
            sent = self.sent.get(index)
            if sent is None:
                out.append((index, name, arguments))
            elif arguments.startswith(sent) and len(arguments) > len(sent):
                out.append((index, None, arguments[len(sent) :]))
        return out

    def feed(self, text: str) -> str:
        if self.in_calls:
            self.calls.append(text)
            self._scan(text)
            return ""
        text = self.held + text
        at = self.parser.find(text, self.fresh)
        if at >= 0:
            self.in_calls, self.held = True, ""
            self.calls.append(text[at:])
            self._scan(text[at:])
            return text[:at]
        keep = self.parser.undecided(text, self.fresh)
        self.held, out = text[len(text) - keep :], text[: len(text) - keep]
        self.fresh = self.fresh and not out
        return out

    def finish(self, stopped: bool, schemas: Schemas | None = None) -> tuple[str, list[Call] | None]:
        """What is left to send as content, and the calls (None: none; the held text is content)."""
        held, self.held = self.held + "".join(self.calls), ""
        self.calls.clear()
        calls = parse_region(self.parser, held, stopped, schemas) if self.in_calls else None
        return ("", calls) if calls else (held, None)
