"""Untrusted JSON in, typed values or OpenAI-format errors out: the gateway's hardened body parsing.

The body must be JSON (no ``NaN``), nested at most `MAX_JSON_DEPTH` levels, with every string
valid Unicode; the typed getters name the field and what was wrong in every rejection.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

from fastapi import Request

from gateway.http.errors import ApiError, bad
from gateway.openai.input_workers import InputWorkers

# Deeper JSON is never a real request; the limit also keeps the parser far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Bodies and prompts past this size are parsed and tokenized on a small pool of their own: a few
# huge requests then queue behind each other instead of taking every worker thread from the rest.
LARGE_INPUT_BYTES = 64 * 1024


# -- the body ----------------------------------------------------------------------------------
def parse_json(data: bytes, cooperative: bool = False) -> Any:
    """A request body as JSON, or a 400: not JSON (``NaN`` and ``Infinity`` are not JSON either),
    nested deeper than `MAX_JSON_DEPTH`, or holding a string that is not valid Unicode (a lone
    surrogate such as ``"\\ud800"``, which neither tokenizers nor UTF-8 encoders accept).

    ``cooperative``: for a worker thread parsing a large body. The C parser holds the GIL for the
    whole parse, which for a long array of numbers is long enough to stall the event loop; through
    a Python-level ``parse_int`` the interpreter can switch threads while it parses.
    """
    try:  # UTF-8, as JSON over HTTP must be (json.loads takes UTF-16 too); surrogates: see `_check_tree`
        text = data.decode("utf-8", "surrogatepass").removeprefix("\ufeff")  # a BOM may be ignored (RFC 8259)
        body = json.loads(text, parse_constant=_not_json, parse_int=_parse_int if cooperative else None)
    except RecursionError:  # far deeper than MAX_JSON_DEPTH
        raise _too_deep(None) from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    _check_tree(body)
    return body


def _parse_int(digits: str) -> int:
    return int(digits)  # Python code on purpose: see `parse_json`


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _too_deep(param: str | None) -> ApiError:
    return bad(f"request body is nested more than {MAX_JSON_DEPTH} levels deep", param, "invalid_json")


def _check_tree(body: Any) -> None:
    """Reject nesting past `MAX_JSON_DEPTH` and invalid strings; errors name the top-level field."""
    if isinstance(body, str):
        check_text(body, None)
    if not isinstance(body, (dict, list)):
        return
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(where)
        if isinstance(value, dict):
            for key, item in value.items():
                check_text(key, where)
                name = key[:64] if where is None else where
                if isinstance(item, str):
                    check_text(item, name)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, name))
        else:
            for item in value:
                if isinstance(item, str):
                    check_text(item, where)
                elif isinstance(item, (dict, list)):
                    stack.append((item, depth + 1, where))


def check_text(text: str, where: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # The message names the code point but never holds it: it could not be encoded either.
        raise bad(
            f"{f'{where!r}' if where else 'request body'} holds a string that is not valid Unicode "
            f"(lone surrogate \\u{ord(text[exc.start]):04x} at index {exc.start})",
            where,
            "invalid_string",
        ) from None


# -- typed getters -----------------------------------------------------------------------------
def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def all_ints(values: list[Any]) -> bool:
    """Every item an integer (not a boolean); builtins, not a Python loop."""
    return set(map(type, values)) <= {int}


def typename(v: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        type(None): "null",
        float: "number",
        int: "integer",
    }.get(type(v), type(v).__name__)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40
_REPR.maxlist = _REPR.maxdict = 4


def preview(value: Any) -> str:
    """A short rendering of a value from the body, whatever its size, for an error message."""
    return _REPR.repr(value)


def get_field(body: dict[str, Any], name: str, check: Any, want: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(f"'{name}' must be {want}, got {typename(value)} {preview(value)}", name)
    return value


def get_int(body: dict[str, Any], name: str, default: Any) -> Any:
    return get_field(body, name, is_int, "an integer", default)


def get_num(body: dict[str, Any], name: str, default: Any) -> Any:
    return get_field(body, name, is_num, "a number", default)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    return bool(get_field(body, name, lambda v: isinstance(v, bool), "a boolean", default))


def json_size(value: Any, limit: int = LARGE_INPUT_BYTES) -> int:
    """About how many bytes ``value`` (parsed JSON) takes; the count stops once past ``limit``, so
    sizing a huge value on the event loop costs no more than sizing a large one."""
    size, todo = 0, [value]
    while todo and size <= limit:
        item = todo.pop()
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict):
            size += 2
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            size += 2
            todo.extend(item)
        else:
            size += 8
    return size


async def read_json(request: Request, limit: int, workers: InputWorkers) -> Any:
    """The body as JSON (a 400 unless `parse_json` accepts it); 413 past ``limit`` bytes (checked
    while reading). A large body is parsed off the event loop."""
    declared = request.headers.get("content-length", "")
    # ASCII digits only ("²".isdigit() is true), and few enough for int() to be cheap and safe.
    if declared.isascii() and declared.isdigit() and len(declared) <= 18 and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over the {limit}-byte limit", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the {limit}-byte limit", code="request_too_large")
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) > LARGE_INPUT_BYTES:
        return await workers.run(True, parse_json, data, True)
    return parse_json(data)
