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
what may be the start of a call's tag, held until the next piece tells). From the tag on, every
parser streams each call as vLLM does: its name (and id) once known, then its arguments in
pieces. hermes and llama3_json read their JSON call objects incrementally
(`gateway.output.call_deltas`); mistral, pythonic and qwen3_coder read the text from the first
call on again as it grows (`CallStream`), each parser's ``partial`` giving the start of every
call's arguments that no later text can change. Arguments written as JSON (hermes, llama3_json,
mistral) are the model's text with the whitespace between tokens dropped, in a response too;
those built from parsed values (pythonic, qwen3_coder) are the JSON of the values read. Either
way a streamed piece is never taken back: the pieces join to the response's arguments. A stream
and a response of the same tokens agree, a resumed stream included.
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


# A JSON string (maybe still open at the end) or a run of the whitespace JSON allows between tokens.
_STRING_OR_SPACE = re.compile(r'("[^"\\]*(?:\\.[^"\\]*)*"?)|[ \t\n\r]+', re.DOTALL)


def compact(text: str) -> str:
    """JSON text without the whitespace between its tokens. It reads char by char, so a text's
    prefix compacts to a prefix of the text's compaction: streamed pieces join to the whole."""
    return _STRING_OR_SPACE.sub(lambda m: m.group(1) or "", text)


def _item(key: str, value: Any) -> str | None:
    """One ``"key":value`` member of a call's arguments, as `arguments_json` writes it; None: no JSON."""
    text = arguments_json({key: value})
    return None if text is None else text[1:-1]


def _key(key: str) -> str:
    """A member's ``"key":``, as `arguments_json` writes it."""
    return json.dumps(key, ensure_ascii=False) + ":"


def _string_prefix(text: str) -> str:
    """The JSON of a string value that begins with ``text``, without its closing quote."""
    return json.dumps(text, ensure_ascii=False)[:-1]


def _scanned(text: str, depth: int, keys: tuple[str, ...], ended: bool) -> list[Call]:
    """The (name, arguments) of the JSON call objects in ``text`` as `CallScanner` reads them so
    far (``ended``: the text is whole, so a call without arguments has ``{}``)."""
    scanner = CallScanner(depth, keys)
    pieces = scanner.feed(text)
    return join_pieces([*pieces, *scanner.finish()] if ended else pieces)


def _as_written(calls: list[Call], scanned: list[Call]) -> list[Call]:
    """``calls`` with the arguments as the model wrote them (``scanned``: compacted JSON text) where
    both readings agree; an object with two argument keys, or stray JSON between calls, keeps
    the parser's reading."""
    if len(scanned) != len(calls):
        return calls
    return [
        (name, raw) if raw_name == name and _loads(raw) == _loads(arguments) else (name, arguments)
        for (name, arguments), (raw_name, raw) in zip(calls, scanned)
    ]


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

    def partial(self, region: str, schemas: Schemas | None = None) -> list[Call]:
        """The calls begun in ``region`` so far: each name once known, with the start of its
        arguments that no later text changes (a prefix of the whole call's)."""
        return _scanned(region, 1, self.argument_keys, False)


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

    def partial(self, region: str, schemas: Schemas | None = None) -> list[Call]:
        return _scanned(region, 1, self.argument_keys, False)


@dataclass(frozen=True, slots=True)
class MistralParser:
    """Calls after ``[TOOL_CALLS]`` to the end: a JSON array of ``{"name", "arguments"}`` (Mistral's
    tokenizers before v11), or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (v11 and later).
    Its call ids are 9 letters and digits: Mistral's chat templates refuse others in a later turn."""

    name: str = "mistral"
    start: str = "[TOOL_CALLS]"
    args: str = "[ARGS]"
    id_length: int = 9
    argument_keys: tuple[str, ...] = ()  # (not one JSON object per call: streamed by `partial`)

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
            found = [_call(v, ARGUMENT_KEYS) for v in value]
        else:
            found = []
            for name, arguments in self._v11_parts(region):
                value = _loads(arguments)
                found.append(_call({"name": name, "arguments": value}, ARGUMENT_KEYS) if name is not None else None)
        calls = [c for c in found if c is not None]
        if len(calls) < len(found):
            return None
        # The arguments as written (compacted), which the streamed pieces join to.
        return _as_written(calls, _scanned(body, 2, ARGUMENT_KEYS, True) if body.startswith("[") else self.partial(region))

    def _v11_parts(self, region: str) -> list[tuple[str | None, str]]:
        """Each call's name (None: none) and arguments text in v11's ``name[ARGS]{...}`` form."""
        parts: list[tuple[str | None, str]] = []
        for part in region.split(self.start)[1:]:
            name, found, arguments = part.partition(self.args)
            name = name.partition("[CALL_ID]")[0].strip()  # (v11 chat turns put an id there; a model may echo it)
            parts.append((name if found and name else None, arguments))
        return parts

    def partial(self, region: str, schemas: Schemas | None = None) -> list[Call]:
        """As `HermesParser.partial`; a tail that may begin ``[TOOL_CALLS]`` waits (in v11's form
        it ends the arguments before it)."""
        body = region[len(self.start) :].lstrip()
        if body.startswith("["):
            return _scanned(body, 2, ARGUMENT_KEYS, False)
        out: list[Call] = []
        for name, arguments in self._v11_parts(region[: len(region) - tag_prefix(region, self.start)]):
            if name is None:
                break
            out.append((name, compact(arguments)))
        return out


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
                names = [k.arg for k in node.keywords]
                if None in names or len(set(names)) < len(names):  # (``**kwargs``; a repeated keyword)
                    return None
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                found.append(_call({"name": node.func.id, "arguments": arguments}, ARGUMENT_KEYS))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # (not literals, or nested too deep)
            return None
        return None if any(c is None for c in found) else [c for c in found if c is not None]

    def partial(self, region: str, schemas: Schemas | None = None) -> list[Call]:
        """As `HermesParser.partial`: a call's name once its ``(`` comes, then each keyword as
        ``"key":`` once its ``=`` comes and its value once the ``,`` or ``)`` after it does (a
        plain string value as its characters come, up to a backslash). Anything Python reads
        otherwise (a comment, a line continuation, a value that is not a literal) stops the
        streaming: the rest comes whole at the end."""
        body = region.lstrip().removeprefix(self.tags[0]).lstrip()
        if not body.startswith("["):
            return []
        return _PythonicReader(body).read()


class _PythonicReader:
    """One pass of `PythonicParser.partial` over the text of a list of calls: brackets and strings
    are tracked (quotes, triple quotes, escapes) to find the top-level commas and parentheses."""

    def __init__(self, body: str) -> None:
        self.body = body
        self.calls: list[tuple[str, list[str], bool]] = []  # name, "key":value members, closed
        self.seen: set[str] = set()  # the open call's keywords

    def read(self) -> list[Call]:
        body, at, depth, start = self.body, 1, 1, 1  # (start: of the current call, or keyword)
        open_string = -1  # where a string still open at the end begins
        while at < len(body):
            ch = body[at]
            if ch in "\"'":
                quote = ch * 3 if body.startswith(ch * 3, at) else ch
                end = self._string_end(at + len(quote), quote)
                if end < 0:
                    open_string = at
                    break
                at = end
                continue
            if ch in "#\\":
                return self._out(None)
            if ch in "([{":
                if depth == 1:  # (only a call opens here)
                    name = body[start:at].strip()
                    if ch != "(" or not name.isidentifier():
                        return self._out(None)
                    self.calls.append((name, [], False))
                    self.seen = set()
                    start = at + 1
                depth += 1
            elif ch in ")]}" or (ch == "," and depth <= 2):
                if depth == 2 and ch in "),":
                    if not self._keyword(body[start:at], ch == ")"):
                        return self._out(None)
                    start = at + 1
                elif depth == 1 and ch == ",":
                    start = at + 1
                if ch != ",":
                    depth -= 1
                    if depth == 0:
                        break
            at += 1
        return self._out(self._open_keyword(body[start:], open_string - start) if depth >= 2 else None)

    def _string_end(self, at: int, quote: str) -> int:
        """Where the string whose text begins at ``at`` ends (after its quote); -1: still open."""
        while True:
            found = [i for i in (self.body.find(quote, at), self.body.find("\\", at)) if i >= 0]
            if not found:
                return -1
            at = min(found)
            if self.body[at] == "\\":
                at += 2
                continue
            return at + len(quote)

    def _keyword(self, text: str, closes: bool) -> bool:
        """One whole ``key=value`` of the open call (``closes``: its ``)`` follows); False: it is
        none the parser would take."""
        name, members, _ = self.calls[-1]
        if not text.strip() and closes:  # (``f()``, or a trailing comma)
            self.calls[-1] = (name, members, True)
            return True
        key, eq, value = text.partition("=")
        key = key.strip()
        if not (eq and key.isidentifier()) or key in self.seen:
            return False
        try:
            member = _item(key, ast.literal_eval(value.strip()))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return False
        if member is None:
            return False
        self.seen.add(key)
        members.append(member)
        self.calls[-1] = (name, members, closes)
        return True

    def _open_keyword(self, text: str, string_at: int) -> str | None:
        """The open call's keyword being written: ``"key":`` and the start of a plain string value
        still open at the end (``string_at``: where in ``text``; negative: none)."""
        before, eq, value = text.partition("=")
        key = before.strip()
        if not (eq and key.isidentifier()) or key in self.seen:
            return None
        head = _key(key)
        begins = len(before) + 1 + len(value) - len(value.lstrip())  # (where the value begins)
        quote = value.lstrip()[:1]
        if string_at != begins or not quote or value.lstrip().startswith(quote * 3):
            return head
        chars = value.lstrip()[1:]
        for stop in ("\\", quote):  # (up to an escape; a closing quote may have a literal after it)
            chars = chars.partition(stop)[0]
        return head + _string_prefix(chars)

    def _out(self, tail: str | None) -> list[Call]:
        """The calls read, the open one's arguments ending with ``tail`` (its keyword being written)."""
        out: list[Call] = []
        for i, (name, members, closed) in enumerate(self.calls):
            arguments = "{" + ",".join(members)
            if closed:
                arguments += "}"
            elif tail is not None and i == len(self.calls) - 1:
                arguments += ("," if members else "") + tail
            out.append((name, arguments))
        return out


# (A name stops at "<" too, so a run of "<function=" is read in linear time, not quadratic.)
_FUNCTION = re.compile(r"<function=([^>\n<]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n<]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
# What may end a value (a tail that may begin one waits while streaming).
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>", "<tool_call>", "</tool_call>")


@dataclass(frozen=True, slots=True)
class Qwen3CoderParser:
    """Qwen3-Coder's XML calls: ``<tool_call><function=NAME><parameter=P>value</parameter>...
    </function></tool_call>``, or the functions without the ``<tool_call>`` around them (as
    vLLM's reads them too). A value is text, typed by its parameter's schema in the request's tools
    (`_typed`); a parameter given twice keeps its first value (so what streamed of it stays)."""

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
                properties = _properties(schemas, name)
                arguments: dict[str, Any] = {}
                for key, value in _PARAMETER.findall(function.group(2)):
                    if key.strip() not in arguments:
                        arguments[key.strip()] = _typed(value.removeprefix("\n").removesuffix("\n"), properties.get(key.strip()))
                call = _call({"name": name, "arguments": arguments}, ARGUMENT_KEYS) if name else None
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def partial(self, region: str, schemas: Schemas | None = None) -> list[Call]:
        """As `HermesParser.partial`: a call's name once its ``<function=NAME>`` is whole, then
        each parameter's ``"key":`` once its tag is, its value once it ends (a string value as
        its characters come: one its schema types a string, or no schema types)."""
        if region.startswith(self.start):
            parts = [b.partition(self.end) for b in region.split(self.start)[1:]]
            blocks = [(body, bool(closed) or i < len(parts) - 1) for i, (body, closed, _) in enumerate(parts)]
        else:
            blocks = [(region, False)]
        out: list[Call] = []
        for body, whole in blocks:
            functions = list(_FUNCTION.finditer(body))
            for function in functions:
                name = function.group(1).strip()
                if not name:
                    return out
                ended = whole or function.group(0).endswith("</function>")
                out.append((name, _partial_arguments(function.group(2), ended, _properties(schemas, name))))
            if not functions:
                break
        return out


def _properties(schemas: Schemas | None, name: str) -> dict[str, Any]:
    """The ``properties`` of function ``name``'s parameter schema ({}: none)."""
    properties = ((schemas or {}).get(name) or {}).get("properties")
    return properties if isinstance(properties, dict) else {}


def _partial_arguments(text: str, ended: bool, properties: dict[str, Any]) -> str:
    """The arguments JSON of a qwen3_coder function whose body so far is ``text`` (``ended``: all
    of it), as far as later text cannot change it."""
    members: list[str] = []
    seen: set[str] = set()
    tail = ""
    for match in _PARAMETER.finditer(text):
        key, value = match.group(1).strip(), match.group(2)
        if key in seen:
            continue
        schema = properties.get(key)
        if not (ended or match.end() < len(text) or match.group(0).endswith("</parameter>")):
            tail = _open_value(key, value, schema)  # (the last parameter, still being written)
            break
        member = _item(key, _typed(value.removeprefix("\n").removesuffix("\n"), schema))
        if member is None:  # (no JSON: the call will not parse)
            break
        seen.add(key)
        members.append(member)
    if ended:
        return "{" + ",".join(members) + "}"
    return "{" + ",".join([*members, tail] if tail else members)


def _open_value(key: str, value: str, schema: Any) -> str:
    """``"key":`` and the start of a value still being written, where it is a string whatever
    comes (`_typed`): the text so far, less a tail that may begin a closing tag, its first
    newline and a last one (the value drops one at each end)."""
    kinds = _types(schema)
    if "null" in kinds or (kinds and "string" not in kinds):
        return _key(key)
    value = value[: len(value) - max(tag_prefix(value, end) for end in _VALUE_ENDS)]
    if not value:
        return _key(key)
    value = value.removeprefix("\n")
    return _key(key) + _string_prefix(value[:-1] if value.endswith("\n") else value)


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
    # (the scanner takes the first argument key it meets, the parser its own first)
    return _as_written(calls, _scanned(region, 1, parser.argument_keys, True))


# A parser without a scanner re-reads its calls' text once it has grown by this fraction of itself
# since it last did (or more): the reading of a long call costs a constant factor of its length.
REREAD_GROWTH = 8


class CallStream:
    """One streamed choice's text through a parser: `feed` returns the content that can go out now,
    `pieces` the call pieces it completed; `finish` the rest of the content and the calls once
    the output has ended, and `last_pieces` what of them is still to go out. A parser whose
    calls are JSON objects (``argument_keys``) has them read incrementally (`CallScanner`); the
    others' `partial` reads the text from the first call on again as it grows, and what it
    reads beyond what was sent goes out."""

    def __init__(self, parser: ToolCallParser, schemas: Schemas | None = None) -> None:
        self.parser = parser
        self.schemas = schemas
        self.held = ""  # text not sent: an undecided tail
        self.calls: list[str] = []  # everything from the first call on (joined once at the end: joining per piece is quadratic)
        self.in_calls = False
        self.fresh = True  # no content sent yet
        self.scanner = CallScanner(1, parser.argument_keys) if parser.argument_keys else None
        self.new: list[CallPiece] = []  # pieces not yet taken
        self.sent: dict[int, str] = {}  # call index -> its arguments sent or to be (its name went out)
        self.size = 0  # of the text from the first call on
        self.read_at = 0  # its size when `partial` last read it

    def _scan(self, text: str) -> None:
        self.size += len(text)
        if self.scanner is not None:
            self._queue(self.scanner.feed(text))
        elif (self.size - self.read_at) * REREAD_GROWTH >= self.size:
            self.read_at = self.size
            self.calls[:] = ["".join(self.calls)]
            pieces: list[CallPiece] = []
            for index, (name, arguments) in enumerate(self.parser.partial(self.calls[0], self.schemas)):
                sent = self.sent.get(index)
                if sent is None:
                    pieces.append((index, name, arguments))
                elif len(arguments) > len(sent) and arguments.startswith(sent):
                    pieces.append((index, None, arguments[len(sent) :]))
            self._queue(pieces)

    def _queue(self, pieces: list[CallPiece]) -> None:
        self.new += pieces
        for index, _name, arguments in pieces:
            self.sent[index] = self.sent.get(index, "") + arguments

    def pieces(self) -> list[CallPiece]:
        """The call pieces completed since the last call."""
        out, self.new = self.new, []
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

    def finish(self, stopped: bool) -> tuple[str, list[Call] | None]:
        """What is left to send as content, and the calls (None: none; the held text is content)."""
        held, self.held = self.held + "".join(self.calls), ""
        self.calls.clear()
        calls = parse_region(self.parser, held, stopped, self.schemas) if self.in_calls else None
        return ("", calls) if calls else (held, None)
