"""The wire protocol between gateway, scheduler and executor: stream names and message types.

Every message is a ``@dataclass(slots=True)`` encoded as one msgpack map
``{"v": PROTOCOL_VERSION, "t": <type tag>, <field>: <value>, ...}`` stored in the single field
``m`` of a Redis stream entry. No pickle: decoding never runs code, and `decode` checks the
version, the type tag, every field's presence and type, and the size, raising `ProtocolError`
with a message that says what is wrong. Token ids and other integer columns travel as packed
little-endian int32 arrays (fields marked ``packed("i")``); batches are columnar (one list per
attribute, not one map per sequence), which is ~4x cheaper to pack and ~6x smaller.

Streams and keys (all names carry a namespace prefix so several stacks or test runs share one
Redis). Every one has an owner that bounds it:

===========================  ===========================  =======================================
stream / key                 direction                    discipline and bound
===========================  ===========================  =======================================
``requests:<scheduler>``     gateways -> one scheduler    single reader; trimmed as it is read
``steps:<scheduler>``        scheduler -> its executor    single reader, epoch-checked; MAXLEN
``results:<scheduler>``      executor -> its scheduler    single reader; MAXLEN
``outputs:<gateway>``        schedulers -> one gateway    single reader; MAXLEN + TTL (refreshed)
``journal:<response>``       gateway (scheduler while     resumable SSE streams; TTL (refreshed)
                             orphaned) -> any gateway
``dead``                     anyone                       malformed messages; MAXLEN
``hb:<kind>:<id>``           key with TTL                 liveness of gateways and executors
``engine:<scheduler>``       key with TTL                 `EngineStatus`: liveness, model, load
``engines``                  sorted set                   scheduler ids seen (score: last beat)
===========================  ===========================  =======================================
"""

from __future__ import annotations

import sys
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Union

import msgpack

from common.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
# Default ceiling on one encoded message: a 1M-token prompt is 4 MB packed; a step of 2048
# prefill tokens is ~10 KB. Bigger means a bug or an attack, not a request.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
ENTRY_FIELD = b"m"
# Stream caps (XADD MAXLEN ~). Steps and results have one reader that keeps up step by step, so a
# short tail suffices; outputs are read by gateways at their own pace and keep more.
STEPS_MAXLEN = 1_000
RESULTS_MAXLEN = 2_000
OUTPUTS_MAXLEN = 20_000
# An outputs stream outlives its gateway by this long at most (every send refreshes it), so a dead
# gateway's stream is removed by Redis itself.
OUTPUTS_TTL_MS = 120_000
# The engine streams (steps, results) outlive their engine by this long at most.
ENGINE_STREAMS_TTL_MS = 3_600_000
# Engine registrations not refreshed for this long are dropped from the ``engines`` set.
ENGINE_FORGET_S = 600.0


def apply_edit(store: list[int], start: int, values: list[int]) -> None:
    """The `StepDelta` edit rule: ``store[start:] = values``, padding with -1 (unknown) past the end."""
    if start > len(store):
        store.extend([-1] * (start - len(store)))
    del store[start:]
    store.extend(values)


class ProtocolError(ValueError):
    """A message that cannot be decoded: garbage, wrong version, unknown type, bad field."""


# -- names ---------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Names:
    """Every stream and key name, under one namespace prefix."""

    namespace: str = "conveyor"

    @property
    def dead_letter(self) -> str:
        return f"{self.namespace}:dead"

    @property
    def engines(self) -> str:
        return f"{self.namespace}:engines"

    def requests(self, scheduler_id: str) -> str:
        return f"{self.namespace}:requests:{scheduler_id}"

    def engine(self, scheduler_id: str) -> str:
        return f"{self.namespace}:engine:{scheduler_id}"

    def steps(self, scheduler_id: str) -> str:
        return f"{self.namespace}:steps:{scheduler_id}"

    def results(self, scheduler_id: str) -> str:
        return f"{self.namespace}:results:{scheduler_id}"

    def outputs(self, gateway_id: str) -> str:
        return f"{self.namespace}:outputs:{gateway_id}"

    def journal(self, response_id: str) -> str:
        return f"{self.namespace}:journal:{response_id}"

    def heartbeat(self, kind: str, process_id: str) -> str:
        return f"{self.namespace}:hb:{kind}:{process_id}"


# -- packed columns ------------------------------------------------------------------------------
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


# -- message types -------------------------------------------------------------------------------
@dataclass(slots=True)
class GenerateRequest:
    """gateway -> one scheduler: a validated request, owned by ``gateway_id``.

    ``incarnation`` names the scheduler process it is meant for: a restarted scheduler ignores
    requests sent to its predecessor (their gateways migrate them). ``output_token_ids`` are
    tokens already generated and streamed by an earlier attempt (a migrated request continues
    after them; ``max_tokens`` and seeds count them). ``journal_id`` is set for a resumable
    stream: if the gateway dies, the scheduler journals its outputs there until one adopts it.
    """

    request_id: str
    gateway_id: str
    scheduler_id: str
    incarnation: str
    prompt_token_ids: list[int] = packed("i")
    output_token_ids: list[int] = packed("i")
    sampling: dict[str, Any] = field(default_factory=dict)  # `SamplingParams` fields
    arrival_time: float = 0.0
    journal_id: str = ""


@dataclass(slots=True)
class AbortRequests:
    """gateway -> one scheduler (its requests stream): stop these requests and free their blocks."""

    request_ids: list[str]
    reason: str = "abort"


@dataclass(slots=True)
class SyncRequest:
    """gateway -> one scheduler: route ``request_id``'s outputs to ``gateway_id`` from now on, and
    resend every output token from ``from_index`` (a gateway adopting an orphaned stream, or
    catching up after outputs were lost). A scheduler that does not hold the request answers
    with finish reason ``unknown``, and the gateway resubmits it."""

    request_id: str
    gateway_id: str
    from_index: int


@dataclass(slots=True)
class ExecutorHello:
    """executor -> scheduler (results stream): I am up; this is my model and KV cache."""

    executor_id: str
    model_name: str
    model_path: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = packed("i")


@dataclass(slots=True)
class BindExecutor:
    """scheduler -> executor (steps stream): start serving ``epoch``; drop all older state."""

    executor_id: str
    scheduler_id: str
    epoch: int


@dataclass(slots=True)
class StepDelta:
    """scheduler -> executor: one engine step, as changes to the executor's per-request state.

    ``release``: requests to forget first. ``new_ids``/``new_sampling``: requests seen for the
    first time (or reset). Per scheduled sequence, in batch order: ``query_lens``, ``seq_lens``,
    ``output_lens``, ``sample``; token store edit ``tokens[token_starts[i]:] = <next
    num_new_tokens[i] of new_tokens>`` (padding with -1 up to the start); block table edit
    ``table[block_starts[i]:] = <next num_new_blocks[i] of new_blocks>``. Slot mappings follow
    from the block table except for the sequences listed in ``slot_seqs`` (their explicit slots
    are concatenated in ``slots``).
    """

    epoch: int
    step: int
    release: list[str] = field(default_factory=list)
    new_ids: list[str] = field(default_factory=list)
    new_sampling: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    query_lens: list[int] = packed("i")
    seq_lens: list[int] = packed("i")
    output_lens: list[int] = packed("i")
    sample: list[bool] = field(default_factory=list)
    token_starts: list[int] = packed("i")
    num_new_tokens: list[int] = packed("i")
    new_tokens: list[int] = packed("i")
    block_starts: list[int] = packed("i")
    num_new_blocks: list[int] = packed("i")
    new_blocks: list[int] = packed("i")
    slot_seqs: list[int] = packed("i")
    slots: list[int] = packed("i")


@dataclass(slots=True)
class StepResult:
    """executor -> scheduler: sampled tokens of step ``step`` (batch order), or an error.

    Logprobs are columnar: ``lp_counts[i]`` entries (-1: none) of ``lp_token_ids``/``lp_values``.
    """

    epoch: int
    step: int
    token_ids: list[int] = packed("i")
    lp_counts: list[int] = packed("i")
    lp_token_ids: list[int] = packed("i")
    lp_values: list[float] = packed("d")
    error: str | None = None
    forward_s: float = 0.0


@dataclass(slots=True)
class StepOutputs:
    """scheduler -> one gateway: what one engine step produced for that gateway's requests.

    Per request: ``token_index`` is the output index of its first new token (a reader drops
    duplicates and detects gaps with it); ``num_tokens`` new tokens are concatenated in
    ``token_ids``; logprobs are per token, columnar as in `StepResult`, and ``lp_counts`` is
    empty when no request of the message asked for them.
    """

    request_ids: list[str] = field(default_factory=list)
    token_index: list[int] = packed("i")
    num_tokens: list[int] = packed("i")
    token_ids: list[int] = packed("i")
    finished: list[bool] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    lp_counts: list[int] = packed("i")
    lp_token_ids: list[int] = packed("i")
    lp_values: list[float] = packed("d")

    def add(self, request_id: str, index: int, tokens: list[int], logprobs: list[dict[int, float] | None] | None,
            finished: bool = False, finish_reason: str | None = None, error: str | None = None) -> None:
        """Append one request's tokens (the first at output index ``index``)."""
        self.request_ids.append(request_id)
        self.token_index.append(index)
        self.num_tokens.append(len(tokens))
        self.token_ids.extend(tokens)
        self.finished.append(finished)
        self.finish_reasons.append(finish_reason)
        self.errors.append(error)
        if logprobs and any(lp is not None for lp in logprobs):
            counts, ids, values = pack_logprobs(logprobs)
        else:  # the common case: no logprobs requested
            counts, ids, values = [-1] * len(tokens), [], []
        self.lp_counts.extend(counts)
        self.lp_token_ids.extend(ids)
        self.lp_values.extend(values)

    def sealed(self) -> StepOutputs:
        """Ready to send: without logprob columns when no request asked for logprobs."""
        if not self.lp_token_ids:
            self.lp_counts.clear()  # the reader then skips unpacking
        return self


@dataclass(slots=True)
class EngineStatus:
    """Stored under ``engine:<scheduler>`` with a TTL: one engine's liveness, model and load.

    Written by the scheduler every heartbeat interval (and sooner when its load changes); its
    absence means the scheduler is gone, a new ``incarnation`` that it restarted. Model fields
    are empty until an executor has bound; ``executor_id`` is empty while none is bound.
    """

    scheduler_id: str
    incarnation: str
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    executor_id: str
    epoch: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    num_dead_letters: int
    updated_at: float
    # Step timing (sums since start): total step wall time and executor forward time.
    step_wall_s: float = 0.0
    step_forward_s: float = 0.0
    step_count: int = 0
    # Prefix cache (sums since start, in tokens): tokens of admitted requests, and of those the
    # tokens found in the cache (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def load(self) -> int:
        """Routing cost: a waiting request weighs more (it still needs its prefill); vLLM's DP
        balancer uses the same ``4 x waiting + running``."""
        return 4 * self.num_waiting + self.num_running


@dataclass(slots=True)
class JournalHeader:
    """First entry of ``journal:<response>``: what a gateway needs to re-create the response."""

    response_id: str
    kind: str  # "completion" | "chat"
    body: str  # the request's JSON
    served_model: str
    created: int
    max_tokens: int
    prompt_token_ids: list[int] = packed("i")
    echo_text: str | None = None


@dataclass(slots=True)
class Route:
    """Journal entry: the request now runs as ``request_id`` on scheduler ``scheduler_id``."""

    request_id: str
    scheduler_id: str


MESSAGE_TYPES: dict[str, type] = {
    "req": GenerateRequest,
    "abort": AbortRequests,
    "sync": SyncRequest,
    "hello": ExecutorHello,
    "bind": BindExecutor,
    "step": StepDelta,
    "result": StepResult,
    "out": StepOutputs,
    "engine": EngineStatus,
    "jhead": JournalHeader,
    "route": Route,
}
_TAGS: dict[type, str] = {cls: tag for tag, cls in MESSAGE_TYPES.items()}


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A predicate for "``value`` (as msgpack decodes it) fits the type hint ``hint``".

    Built once per field: interpreting the hint for every value (``typing.get_origin`` per list
    element) made decoding a 64-request `StepOutputs` cost ~0.45 ms, a tenth of a decode step.
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


# Per type: (name, resolved type hint, packed code or None, value checker) for each field, built once.
_SCHEMA: dict[type, list[tuple[str, Any, str | None, Callable[[Any], bool]]]] = {
    cls: [(f.name, hint, f.metadata.get("packed"), _checker(hint))
          for f in fields(cls) for hint in [typing.get_type_hints(cls)[f.name]]]
    for cls in MESSAGE_TYPES.values()
}


# -- encode / decode -----------------------------------------------------------------------------
def encode(msg: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Serialize one message; raises `ProtocolError` if it is of no known type or too big."""
    cls = type(msg)
    tag = _TAGS.get(cls)
    if tag is None:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a protocol message type")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": tag}
    for name, _, code, _ in _SCHEMA[cls]:
        value = getattr(msg, name)
        body[name] = pack_array(code, value) if code is not None else value
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > max_bytes:
        raise ProtocolError(f"{cls.__name__} message is {len(data)} bytes, over the {max_bytes}-byte limit")
    return data


def decode(data: bytes, expected: tuple[type, ...] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Parse and type-check one message; raises `ProtocolError` saying what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message is {len(data)} bytes, over the {max_bytes}-byte limit")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"not a msgpack message: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"message must be a msgpack map, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this build speaks {PROTOCOL_VERSION})")
    tag = body.pop("t", None)
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    if expected is not None and cls not in expected:
        want = ", ".join(c.__name__ for c in expected)
        raise ProtocolError(f"unexpected message type {cls.__name__} (expected {want})")
    kwargs: dict[str, Any] = {}
    for name, hint, code, check in _SCHEMA[cls]:
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
    return cls(**kwargs)


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# -- helpers shared by services ------------------------------------------------------------------
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


_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    """`SamplingParams` as the plain map carried by `GenerateRequest` and `StepDelta`."""
    return {name: getattr(params, name) for name in _SAMPLING_FIELDS}
