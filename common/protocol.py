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

from dataclasses import dataclass, field, fields
from typing import Any

from common.codec import Codec, packed
from common.codec import ProtocolError as ProtocolError  # re-exported: readers catch it from here
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
_CODEC = Codec(MESSAGE_TYPES, PROTOCOL_VERSION, MAX_MESSAGE_BYTES)


def encode(msg: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Serialize one message (see `Codec.encode`)."""
    return _CODEC.encode(msg, max_bytes)


def decode(data: bytes, expected: tuple[type, ...] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Parse and type-check one message; raises `ProtocolError` saying what is wrong (see `Codec.decode`)."""
    return _CODEC.decode(data, expected, max_bytes)


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
