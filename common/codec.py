"""The message codec under `common.protocol`: msgpack maps of ``@dataclass(slots=True)`` messages.

`Codec` turns a registry of message types (tag -> class) into ``encode``/``decode``: one msgpack
map ``{"v": version, "t": tag, <field>: <value>, ...}`` per message, no pickle. Decoding checks the
size, version, tag, every field's presence and type, and unknown fields, raising `ProtocolError`
with what is wrong. Integer and float columns travel packed (fields declared with `packed`);
per-token logprobs travel as three columns (`pack_logprobs`, `unpack_logprobs`).
"""

from __future__ import annotations

import sys
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any, Union

import msgpack


class ProtocolError(ValueError):
    """A message that cannot be decoded: garbage, wrong version, unknown type, bad field."""


_LITTLE = sys.byteorder == "little"


def packed(code: str) -> Any:
    """Field marker: a ``list[int]`` ("i", int32) or ``list[float]`` ("d", float64) column."""
    return field(default_factory=list, metadata={"packed": code})


def pack_array(code: str, values: list[int] | list[float]) -> bytes:
    arr = array(code, values)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def unpack_array(code: str, data: bytes) -> list[Any]:
    arr = array(code)
    if len(data) % arr.itemsize:
        raise ValueError(f"packed array of {len(data)} bytes is not a multiple of {arr.itemsize}")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A predicate for "``value`` (as msgpack decodes it) fits the type hint ``hint``".

    Built once per field: interpreting the hint for every value (``typing.get_origin`` per list
    element) would cost a sizeable share of a decode step on every decoded `StepOutputs`.
    """
    if hint is Any:
        return lambda v: True
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        rest = [_checker(h) for h in args if h is not type(None)]
        if len(rest) == 1 and len(args) == 2:  # Optional[X], the usual case
            (check,) = rest
            return lambda v: v is None or check(v)
        checks = [_checker(h) for h in args]
        return lambda v: any(c(v) for c in checks)
    if hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: v is True or v is False
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return lambda v: isinstance(v, str)
    if hint is bytes:
        return lambda v: isinstance(v, bytes)
    if origin is list:
        (item,) = typing.get_args(hint)
        if item is str:  # request ids: the long lists
            return lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)
        check = _checker(item)
        return lambda v: isinstance(v, list) and all(map(check, v))
    if origin is dict:
        key, item = typing.get_args(hint)
        check_key, check_item = _checker(key), _checker(item)
        return lambda v: isinstance(v, dict) and all(check_key(k) and check_item(x) for k, x in v.items())
    raise TypeError(f"protocol schema uses unsupported type {hint!r}")


class Codec:
    """``encode``/``decode`` for one registry of message types (built once: the per-field checks
    are compiled from the type hints up front, not interpreted per value)."""

    def __init__(self, message_types: dict[str, type], version: int, max_bytes: int) -> None:
        self.version = version
        self.max_bytes = max_bytes
        self.types = message_types
        self.tags: dict[type, str] = {cls: tag for tag, cls in message_types.items()}
        # Per type: (name, resolved type hint, packed code or None, value checker) for each field.
        self.schema: dict[type, list[tuple[str, Any, str | None, Callable[[Any], bool]]]] = {
            cls: [
                (f.name, hint, f.metadata.get("packed"), _checker(hint))
                for f in fields(cls)
                for hint in [typing.get_type_hints(cls)[f.name]]
            ]
            for cls in message_types.values()
        }

    def encode(self, msg: Any, max_bytes: int | None = None) -> bytes:
        """Serialize one message; raises `ProtocolError` if it is of no known type or too big."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        cls = type(msg)
        tag = self.tags.get(cls)
        if tag is None:
            raise ProtocolError(f"cannot encode {cls.__name__}: not a protocol message type")
        body: dict[str, Any] = {"v": self.version, "t": tag}
        for name, _, code, _ in self.schema[cls]:
            value = getattr(msg, name)
            # Most columns of a small message are empty (no logprobs, no queue times): b"" as is.
            body[name] = value if code is None else pack_array(code, value) if value else b""
        data = msgpack.packb(body, use_bin_type=True)
        if len(data) > limit:
            raise ProtocolError(f"{cls.__name__} message is {len(data)} bytes, over the {limit}-byte limit")
        return data

    def decode(self, data: bytes, expected: tuple[type, ...] | None = None, max_bytes: int | None = None) -> Any:
        """Parse and type-check one message; raises `ProtocolError` saying what is wrong."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
        if len(data) > limit:
            raise ProtocolError(f"message is {len(data)} bytes, over the {limit}-byte limit")
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            raise ProtocolError(f"not a msgpack message: {exc.__class__.__name__}: {exc}") from None
        if not isinstance(body, dict):
            raise ProtocolError(f"message must be a msgpack map, got {type(body).__name__}")
        version = body.pop("v", None)
        if version != self.version:
            raise ProtocolError(f"unsupported protocol version {version!r} (this build speaks {self.version})")
        tag = body.pop("t", None)
        cls = self.types.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message type {tag!r}")
        if expected is not None and cls not in expected:
            want = ", ".join(c.__name__ for c in expected)
            raise ProtocolError(f"unexpected message type {cls.__name__} (expected {want})")
        kwargs: dict[str, Any] = {}
        for name, hint, code, check in self.schema[cls]:
            if name not in body:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            value = body.pop(name)
            if code is not None:
                if not isinstance(value, bytes):
                    raise ProtocolError(f"{cls.__name__}.{name}: expected packed bytes, got {type(value).__name__}")
                try:
                    value = unpack_array(code, value)
                except ValueError as exc:
                    raise ProtocolError(f"{cls.__name__}.{name}: {exc}") from None
            elif not check(value):
                raise ProtocolError(f"{cls.__name__}.{name}: expected {_hint_name(hint)}, got {_short(value)}")
            kwargs[name] = value
        if body:
            raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(map(str, body))}")
        msg = cls(**kwargs)
        check_columns = getattr(msg, "check_columns", None)  # a columnar message's own consistency
        if check_columns is not None:
            try:
                check_columns()
            except ValueError as exc:
                raise ProtocolError(f"{cls.__name__}: {exc}") from None
        return msg


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# -- logprob columns ----------------------------------------------------------------------------
def pack_logprobs(entries: list[dict[int, float] | None]) -> tuple[list[int], list[int], list[float]]:
    """Columnar form of per-position logprob dicts: (counts with -1 for None, ids, values)."""
    counts: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for entry in entries:
        if entry is None:
            counts.append(-1)
            continue
        counts.append(len(entry))
        ids.extend(entry.keys())
        values.extend(entry.values())
    return counts, ids, values


def unpack_logprobs(counts: list[int], ids: list[int], values: list[float]) -> list[dict[int, float] | None]:
    """Inverse of `pack_logprobs`; raises `ProtocolError` if the columns disagree in length."""
    out: list[dict[int, float] | None] = []
    pos = 0
    for count in counts:
        if count < 0:
            out.append(None)
            continue
        out.append(dict(zip(ids[pos : pos + count], values[pos : pos + count])))
        pos += count
    if pos != len(ids) or len(ids) != len(values):
        raise ProtocolError("logprob columns disagree in length")
    return out


# -- prompt logprobs and wire sizes ------------------------------------------------------------------
class PromptLogprob(dict[int, float]):
    """One prompt position's logprobs: token id -> logprob (the prompt token's, then the top-k),
    and the prompt token's ``rank`` in the whole vocabulary (1: the likeliest; 0: not known),
    which vLLM's ``prompt_logprobs`` reports and the top-k alone cannot tell."""

    __slots__ = ("rank",)

    def __init__(self, entries: dict[int, float] | None = None, rank: int = 0) -> None:
        super().__init__(entries or {})
        self.rank = rank


PromptLogprobs = list[dict[int, float] | None]  # per position; `PromptLogprob` where the rank is known


def rank_of(entry: dict[int, float] | None) -> int:
    """The prompt token's rank an entry carries (0: none)."""
    return entry.rank if isinstance(entry, PromptLogprob) else 0


# Sizes as packed here: what message splitting and the scheduler's byte budget
# (`scheduler.step_bytes`) count.
INT_BYTES = 4  # a packed int32: a token id, block id, count or index
LOGPROB_ENTRY_BYTES = 12  # a packed int32 id and float64 value


def logprobs_bytes(entries: list[dict[int, float] | None] | None) -> int:
    """The packed size of per-position logprob entries (a count each, and their pairs)."""
    return sum(INT_BYTES + LOGPROB_ENTRY_BYTES * len(e) if e else INT_BYTES for e in entries) if entries else 0


def pack_prompt_logprobs(
    per_row: list[PromptLogprobs | None],
) -> tuple[list[int], list[int], list[int], list[float], list[int]]:
    """Columns ``(num, counts, ids, values, ranks)`` of per-row prompt logprobs (None: the row has
    none, ``num`` -1; ``ranks``: one per position, `rank_of`); all empty when no row has any (the
    common case)."""
    if all(entries is None for entries in per_row):
        return [], [], [], [], []
    num = [-1 if entries is None else len(entries) for entries in per_row]
    flat = [e for entries in per_row if entries is not None for e in entries]
    counts, ids, values = pack_logprobs(flat)
    return num, counts, ids, values, [rank_of(e) for e in flat]


def unpack_prompt_logprobs(
    rows: int, num: list[int], counts: list[int], ids: list[int], values: list[float], ranks: list[int] | None = None
) -> list[PromptLogprobs | None]:
    """Inverse of `pack_prompt_logprobs` for ``rows`` rows (all None when the columns are empty);
    raises `ProtocolError` if the columns disagree."""
    if not num:
        return [None] * rows
    if len(num) != rows or sum(max(k, 0) for k in num) != len(counts) or (ranks and len(ranks) != len(counts)):
        raise ProtocolError("prompt-logprob columns disagree with the rows")
    flat: PromptLogprobs = unpack_logprobs(counts, ids, values)
    if ranks:
        flat = [e if e is None else PromptLogprob(e, rank) for e, rank in zip(flat, ranks)]
    out: list[PromptLogprobs | None] = []
    pos = 0
    for k in num:
        if k < 0:
            out.append(None)
        else:
            out.append(flat[pos : pos + k])
            pos += k
    return out
