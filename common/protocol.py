"""The wire protocol between gateway, scheduler and executor: stream names and message types.

Every message is a ``@dataclass(slots=True)`` encoded as one msgpack map
``{"v": PROTOCOL_VERSION, "t": <type tag>, <field>: <value>, ...}`` stored in the single field
``m`` of a Redis stream entry. No pickle: decoding never runs code, and `decode` checks the
version, the type tag, every field's presence and type, and the size, raising `ProtocolError`
with a message that says what is wrong. Token ids and other integer columns travel as packed
little-endian int32 arrays (fields marked ``packed("i")``); batches are columnar (one list per
attribute, not one map per sequence): msgpack then packs a few long arrays instead of a map and its
keys per sequence.

Streams and keys (all names carry a namespace prefix so several stacks or test runs share one
Redis). Every one has an owner that bounds it:

===========================  ===========================  =======================================
stream / key                 direction                    discipline and bound
===========================  ===========================  =======================================
``requests:<scheduler>``     gateways -> one scheduler    single reader; trimmed as it is read
``steps:<scheduler>``        scheduler -> its executor    single reader, epoch-checked; MAXLEN + TTL
``results:<scheduler>``      executor -> its scheduler    single reader; MAXLEN + TTL
``outputs:<gateway>``        schedulers -> one gateway    single reader; MAXLEN + TTL (refreshed)
``journal:<response>``       gateway (scheduler while     resumable SSE streams; TTL (refreshed)
                             orphaned) -> any gateway
``dead``                     anyone                       malformed messages; MAXLEN + TTL
``hb:<kind>:<id>``           key with TTL                 liveness of gateways and executors
``engine:<scheduler>``       key with TTL                 `EngineStatus`: liveness, model, load
``engines``                  sorted set                   scheduler ids seen (score: last beat);
                                                          stale ids dropped, TTL (refreshed)
``executors:unpaired``       sorted set                   executors offering themselves
                                                          (score: Redis's clock); TTL (refreshed)
``claim:<executor>``         key with TTL                 the scheduler that holds an executor
===========================  ===========================  =======================================

Pairing (``--scheduler-id auto``, for replicas started from one template with no ids to give):
an executor nobody holds announces itself in ``executors:unpaired`` and polls its claim key
(`executor.pairing`); a scheduler takes one announced, live executor with ``SET claim:<executor>
<scheduler> NX PX ttl`` and refreshes the claim's TTL on its heartbeat while the value is its own
(`scheduler.pairing`). A scheduler that dies stops refreshing, the claim expires, and the executor
announces itself again. The executor serves the streams of the scheduler named in its claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.codec import (
    INT_BYTES,
    Codec,
    PromptLogprobs,
    logprobs_bytes,
    pack_logprobs,
    packed,
    rank_of,
    unpack_logprobs,
    unpack_prompt_logprobs,
)
from common.codec import ProtocolError as ProtocolError  # re-exported: readers catch it from here
from common.sampling_params import SamplingParams, sampling_to_dict

# Bumped whenever a message or a key name changes shape: messages of another version are rejected
# at decode, and services of two versions would not find each other's streams.
PROTOCOL_VERSION = 8
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
# A `StepOutputs` finish reason for the gateway a stream was taken from: another gateway resumed it
# (`SyncRequest`), so this one ends its copy without journaling anything (the stream goes on there).
TAKEN_OVER = "taken_over"
# A stored Responses API response (its body and the chat history a follow-up turn continues): a
# turn past this is answered but not stored (its request is a 400 up front when its input is).
MAX_STORED_RESPONSE_BYTES = 16 * 1024 * 1024
# A background response's lease (`Names.response_lease`): refreshed every third of it while the
# response runs, so a dead gateway's response reads "failed" within this long.
RESPONSE_LEASE_MS = 15_000
# A streamed background response's typed events (`Names.response_events`) are kept, as long as its
# stored response, for ``GET /v1/responses/{id}?stream=true`` on any gateway: at most this many
# (about one per generated token; a replay from before the oldest kept starts at the oldest).
RESPONSE_EVENTS_MAXLEN = 100_000
# The engine streams (steps, results) outlive their engine by this long at most.
ENGINE_STREAMS_TTL_MS = 3_600_000
# Engine registrations not refreshed for this long are dropped from the ``engines`` set, and the
# set itself expires this long after the last beat of any scheduler.
ENGINE_FORGET_S = 600.0
# Dead letters are for an operator to read; the stream goes a week after the last one.
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_TTL_MS = 7 * 24 * 3_600_000


# Lua that sets ``now`` to the Redis server's clock in ms. Announcements are stamped and aged by it,
# not the hosts' clocks: replicas on machines whose clocks disagree by more than a TTL would
# otherwise see each other's offers as stale.
REDIS_NOW_MS_LUA = "local t = redis.call('time') local now = t[1] * 1000 + math.floor(t[2] / 1000) "


# -- names ---------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Names:
    """Every stream and key name, under one namespace prefix.

    Laid out for Redis Cluster: the keys of one owner (an engine's streams and status, a gateway's
    outputs and heartbeat, a request's journal, a stored response and its events and lease) carry
    one hash tag, ``{<namespace>:<owner id>}``, so they share a slot, and every script and multi-key
    read touches one owner's keys only. On a single Redis the braces are just characters.
    """

    namespace: str = "conveyor"

    def _owned(self, kind: str, owner: str) -> str:
        """``kind``'s key of ``owner``, under the owner's hash tag."""
        return f"{self.namespace}:{kind}:{{{self.namespace}:{owner}}}"

    @property
    def dead_letter(self) -> str:
        return f"{self.namespace}:dead"

    @property
    def engines(self) -> str:
        return f"{self.namespace}:engines"

    def requests(self, scheduler_id: str) -> str:
        return self._owned("requests", scheduler_id)

    def engine(self, scheduler_id: str) -> str:
        return self._owned("engine", scheduler_id)

    def steps(self, scheduler_id: str) -> str:
        return self._owned("steps", scheduler_id)

    def results(self, scheduler_id: str) -> str:
        return self._owned("results", scheduler_id)

    def outputs(self, gateway_id: str) -> str:
        return self._owned("outputs", gateway_id)

    def journal(self, response_id: str) -> str:
        """A resumable stream's journal. Never trimmed: a resume needs its first entries (the
        header and the routes). Bounded by its request (at most ``SamplingParams.MAX_N`` choices of
        at most the model's context each, a route per move) and by its TTL, the resume window."""
        return self._owned("journal", response_id)

    def is_journal(self, stream: str) -> bool:
        """Whether ``stream`` is a `journal` (not a gateway's `outputs`)."""
        return stream.startswith(f"{self.namespace}:journal:")

    def response(self, response_id: str) -> str:
        """A stored Responses API response (a hash: its status, owner, body and chat history),
        bounded by ``MAX_STORED_RESPONSE_BYTES`` and by its TTL (`GatewayConfig.response_ttl_s`)."""
        return self._owned("response", response_id)

    def response_events(self, response_id: str) -> str:
        """A streamed background response's typed events as JSON, in order (``RESPONSE_EVENTS_MAXLEN``,
        the stored response's TTL); served only to the owner of `response` ``response_id``."""
        return self._owned("response-events", response_id)

    def response_lease(self, response_id: str) -> str:
        """Held (with a short TTL, refreshed) by the gateway running a background response: when it
        lapses before the response ends, that gateway is gone and the response has failed."""
        return self._owned("response-lease", response_id)

    def heartbeat(self, kind: str, process_id: str) -> str:
        return self._owned(f"hb:{kind}", process_id)

    @property
    def unpaired_executors(self) -> str:
        return f"{self.namespace}:executors:unpaired"

    def claim(self, executor_id: str) -> str:
        return self._owned("claim", executor_id)


# -- message types -------------------------------------------------------------------------------
@dataclass(slots=True)
class GenerateRequest:
    """gateway -> one scheduler: a validated request, owned by ``gateway_id``.

    ``incarnation`` names the scheduler process it is meant for: a restarted scheduler ignores
    requests sent to its predecessor (their gateways migrate them). ``output_token_ids`` are
    tokens already generated and streamed by an earlier attempt (a migrated request continues
    after them; ``max_tokens`` and seeds count them). ``journal_id`` is set for a resumable
    stream: if the gateway dies, the scheduler journals its outputs there until one adopts it.
    ``group_id`` is shared by the sibling requests of one prompt's ``n`` samples: the scheduler
    admits a sibling once another's prompt blocks are cached, so they share them. ``priority``:
    lower first, under the scheduler's priority policy (`SchedulerConfig.scheduling_policy`).
    ``cache_salt`` (vLLM's; "" for none): its prefix-cache entries are apart from those of
    requests with another salt or none (`Request.cache_salt`).
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
    group_id: str = ""
    priority: int = 0
    cache_salt: str = ""


@dataclass(slots=True)
class AbortRequests:
    """gateway -> one scheduler (its requests stream): stop these requests and free their blocks.

    From ``gateway_id`` (when set) only those no other gateway has adopted since (`SyncRequest`):
    a gateway whose client hung up aborts a stream that the client may be resuming elsewhere.
    """

    request_ids: list[str]
    reason: str = "abort"
    gateway_id: str = ""


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
    sliding_window: int = 0  # `ExecutorInfo.sliding_window`; 0: none
    kv_group_windows: list[int] = packed("i")  # `ExecutorInfo.kv_group_windows`


@dataclass(slots=True)
class BindExecutor:
    """scheduler -> executor (steps stream): start serving ``epoch``; drop all older state."""

    executor_id: str
    scheduler_id: str
    epoch: int


@dataclass(slots=True)
class NewRequestData:
    """A request the executor does not hold yet (first scheduled, or resent after a rebind)."""

    request_id: str
    sampling: dict[str, Any]  # `SamplingParams` fields
    num_prompt_tokens: int
    token_ids: list[int]  # every known token: prompt, then any output already generated
    block_ids: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    """scheduler -> executor: one engine step, as a delta against the executor's request state.

    vLLM v1's shape. The executor keeps, per request, its tokens and block table, and appends the
    tokens it samples itself; so a step carries only what the executor cannot know:

    - new requests (``new_*`` columns, one entry per request; tokens and blocks concatenated);
    - cached requests whose block table changed (``cached_*``): new block ids appended, or, for
      one resumed from preemption, its whole new table;
    - the batch, in order: ``scheduled_req_ids`` with ``num_scheduled_tokens``,
      ``num_computed_tokens`` (the position of each one's first scheduled token) and ``sample``
      (whether it samples a token);
    - ``finished_req_ids``: requests whose state the executor drops first.

    The scheduler alone decides these (a request samples when its scheduled tokens reach the end of
    its tokens, placeholders included); the executor takes them as given, and a request that samples
    takes its token at the position after its last scheduled one (so a step scheduled one ahead
    reads the token its predecessor sampled).
    ``step`` numbers the scheduler's steps; ``epoch`` is the executor binding it was sent to.
    """

    step: int = 0
    epoch: int = 0
    new_req_ids: list[str] = field(default_factory=list)
    new_sampling: list[dict[str, Any]] = field(default_factory=list)
    new_num_prompt_tokens: list[int] = packed("i")
    new_num_tokens: list[int] = packed("i")
    new_token_ids: list[int] = packed("i")
    new_num_blocks: list[int] = packed("i")
    new_block_ids: list[int] = packed("i")
    cached_req_ids: list[str] = field(default_factory=list)
    cached_resumed: list[bool] = field(default_factory=list)
    cached_num_blocks: list[int] = packed("i")
    cached_block_ids: list[int] = packed("i")
    scheduled_req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = packed("i")
    num_computed_tokens: list[int] = packed("i")
    sample: list[bool] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled_req_ids)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add_new(
        self, request_id: str, params: SamplingParams, num_prompt_tokens: int, token_ids: list[int], block_ids: list[int]
    ) -> None:
        self.new_req_ids.append(request_id)
        self.new_sampling.append(sampling_to_dict(params))
        self.new_num_prompt_tokens.append(num_prompt_tokens)
        self.new_num_tokens.append(len(token_ids))
        self.new_token_ids.extend(token_ids)
        self.new_num_blocks.append(len(block_ids))
        self.new_block_ids.extend(block_ids)

    def add_cached(self, request_id: str, resumed: bool, block_ids: list[int]) -> None:
        self.cached_req_ids.append(request_id)
        self.cached_resumed.append(resumed)
        self.cached_num_blocks.append(len(block_ids))
        self.cached_block_ids.extend(block_ids)

    def add_scheduled(self, request_id: str, num_tokens: int, num_computed_tokens: int, sample: bool) -> None:
        self.scheduled_req_ids.append(request_id)
        self.num_scheduled_tokens.append(num_tokens)
        self.num_computed_tokens.append(num_computed_tokens)
        self.sample.append(sample)

    def new_requests(self) -> list[NewRequestData]:
        """The new requests as records; raises `ProtocolError` if the columns disagree."""
        n = len(self.new_req_ids)
        if not (
            len(self.new_sampling) == len(self.new_num_prompt_tokens) == len(self.new_num_tokens) == len(self.new_num_blocks) == n
        ):
            raise ProtocolError("new-request columns differ in length")
        out: list[NewRequestData] = []
        t = b = 0
        for i, request_id in enumerate(self.new_req_ids):
            nt, nb = self.new_num_tokens[i], self.new_num_blocks[i]
            out.append(
                NewRequestData(
                    request_id,
                    self.new_sampling[i],
                    self.new_num_prompt_tokens[i],
                    self.new_token_ids[t : t + nt],
                    self.new_block_ids[b : b + nb],
                )
            )
            t += nt
            b += nb
        if t != len(self.new_token_ids) or b != len(self.new_block_ids):
            raise ProtocolError("new-request token or block columns do not match their counts")
        return out

    def cached_requests(self) -> list[tuple[str, bool, list[int]]]:
        """``(request_id, resumed, block_ids)`` per cached entry; `ProtocolError` if inconsistent."""
        if not len(self.cached_resumed) == len(self.cached_num_blocks) == len(self.cached_req_ids):
            raise ProtocolError("cached-request columns differ in length")
        out: list[tuple[str, bool, list[int]]] = []
        b = 0
        for request_id, resumed, nb in zip(self.cached_req_ids, self.cached_resumed, self.cached_num_blocks):
            out.append((request_id, resumed, self.cached_block_ids[b : b + nb]))
            b += nb
        if b != len(self.cached_block_ids):
            raise ProtocolError("cached-request block column does not match its counts")
        return out


@dataclass(slots=True)
class StepOutputs:
    """scheduler -> one gateway: what one engine step produced for that gateway's requests.

    Per request: ``token_index`` is the output index of its first new token (a reader drops
    duplicates and detects gaps with it); ``num_tokens`` new tokens are concatenated in
    ``token_ids``; logprobs are per token, columnar as in `StepResult`, and ``lp_counts`` is
    empty when no request of the message asked for them. ``queue_time_s`` is the request's time
    from arrival at the scheduler to its first scheduling (vLLM's queue time; the gateway observes
    it), carried once, on the request's first output from that engine: -1 for the others, and
    empty when no request of the message carries it (the common case). ``stop_reason_ids``: on a
    request's last output, the stop token id (of its ``stop_token_ids``) that ended it (vLLM's
    ``stop_reason``); -1 for the others, and empty when no request of the message has one.
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
    queue_time_s: list[float] = packed("d")
    stop_reason_ids: list[int] = packed("i")
    plp_num: list[int] = packed("i")
    plp_counts: list[int] = packed("i")
    plp_token_ids: list[int] = packed("i")
    plp_values: list[float] = packed("d")
    plp_ranks: list[int] = packed("i")  # per prompt position: the prompt token's rank (0: not known)

    def add(
        self,
        request_id: str,
        index: int,
        tokens: list[int],
        logprobs: list[dict[int, float] | None] | None,
        finished: bool = False,
        finish_reason: str | None = None,
        error: str | None = None,
        queue_time_s: float | None = None,
        stop_reason: int | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
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
        self.queue_time_s.append(-1.0 if queue_time_s is None else queue_time_s)
        self.stop_reason_ids.append(-1 if stop_reason is None else stop_reason)
        if prompt_logprobs is not None:
            self.plp_num.extend([-1] * (len(self.request_ids) - 1 - len(self.plp_num)))
            counts, ids, values = pack_logprobs(prompt_logprobs)
            self.plp_num.append(len(prompt_logprobs))
            self.plp_counts.extend(counts)
            self.plp_token_ids.extend(ids)
            self.plp_values.extend(values)
            self.plp_ranks.extend(rank_of(e) for e in prompt_logprobs)

    def check_columns(self) -> None:
        """Raise ``ValueError`` unless the columns describe the same requests and tokens: called by
        `common.codec` on every decode, so a malformed message is dead-lettered alone instead of
        failing its whole read (and every request in it) in the gateway."""
        rows = len(self.request_ids)
        if (
            not len(self.token_index)
            == len(self.num_tokens)
            == len(self.finished)
            == len(self.finish_reasons)
            == len(self.errors)
            == rows
        ):
            raise ValueError(f"per-request columns disagree with the {rows} requests")
        # (min(), not a generator: this runs on every decode, over every token of a step)
        if min(self.num_tokens, default=0) < 0 or sum(self.num_tokens) != len(self.token_ids):
            raise ValueError("num_tokens disagrees with token_ids")
        if min(self.token_index, default=0) < 0 or min(self.token_ids, default=0) < 0:
            raise ValueError("token indices and token ids must not be negative")
        for name in ("queue_time_s", "stop_reason_ids", "plp_num"):
            if len(getattr(self, name)) > rows:
                raise ValueError(f"{name} has more entries than requests")
        if self.lp_counts:
            if len(self.lp_counts) != len(self.token_ids):
                raise ValueError("lp_counts disagrees with token_ids")
            unpack_logprobs(self.lp_counts, self.lp_token_ids, self.lp_values)  # ProtocolError if they disagree
        if self.plp_num:
            self.prompt_logprobs()

    def sealed(self) -> StepOutputs:
        """Ready to send: without logprob columns when no request asked for logprobs, and without
        queue times when none is carried."""
        if not self.lp_token_ids:
            self.lp_counts.clear()  # the reader then skips unpacking
        if self.queue_time_s and max(self.queue_time_s) < 0:
            self.queue_time_s.clear()
        if self.stop_reason_ids and max(self.stop_reason_ids) < 0:
            self.stop_reason_ids.clear()
        if self.plp_num:
            self.plp_num.extend([-1] * (len(self.request_ids) - len(self.plp_num)))
        return self

    def prompt_logprobs(self) -> list[PromptLogprobs | None]:
        """Per request, its prompt logprobs (None where not carried)."""
        num = self.plp_num + [-1] * (len(self.request_ids) - len(self.plp_num)) if self.plp_num else []
        return unpack_prompt_logprobs(
            len(self.request_ids), num, self.plp_counts, self.plp_token_ids, self.plp_values, self.plp_ranks
        )

    def queue_times(self) -> list[float | None]:
        """``queue_time_s`` per request, None where not carried (all None if the column is absent
        or does not match the requests)."""
        if len(self.queue_time_s) != len(self.request_ids):
            return [None] * len(self.request_ids)
        return [q if q >= 0 else None for q in self.queue_time_s]

    def stop_reasons(self) -> list[int | None]:
        """``stop_reason_ids`` per request: the stop token id that ended it, None where none did
        (all None if the column is absent or does not match the requests)."""
        if len(self.stop_reason_ids) != len(self.request_ids):
            return [None] * len(self.request_ids)
        return [t if t >= 0 else None for t in self.stop_reason_ids]


# About what a row of a `StepOutputs` takes besides its tokens and logprobs: its request id, flags
# and one-per-row columns.
ROW_BYTES = 64  # about: a row's request id, flags and one-per-row columns


def row_bytes(tokens: list[int], logprobs: list[dict[int, float] | None] | None, prompt: PromptLogprobs | None) -> int:
    """About what one row of a `StepOutputs` adds to its encoded size."""
    return ROW_BYTES + INT_BYTES * len(tokens) + logprobs_bytes(logprobs) + logprobs_bytes(prompt)


@dataclass(slots=True)
class StepResult:
    """executor -> scheduler: sampled tokens of step ``step`` (batch order; -1 where a request
    did not sample), or an error.

    Logprobs are columnar: ``lp_counts[i]`` entries (-1: none) of ``lp_token_ids``/``lp_values``.
    Prompt logprobs (requests with ``prompt_logprobs``): ``plp_num[i]`` entries (-1: none; the
    column is empty when no request has any) of the ``plp_*`` columns, for the prompt positions
    the step computed (see `common.codec.pack_prompt_logprobs`).
    """

    epoch: int
    step: int
    token_ids: list[int] = packed("i")
    lp_counts: list[int] = packed("i")
    lp_token_ids: list[int] = packed("i")
    lp_values: list[float] = packed("d")
    error: str | None = None
    forward_s: float = 0.0
    plp_num: list[int] = packed("i")
    plp_counts: list[int] = packed("i")
    plp_token_ids: list[int] = packed("i")
    plp_values: list[float] = packed("d")
    plp_ranks: list[int] = packed("i")  # per prompt position: the prompt token's rank (0: not known)

    def check_columns(self) -> None:
        """Raise ``ValueError`` unless the logprob columns agree with the tokens (called by
        `common.codec` on decode: a malformed result is dead-lettered, it does not fail the step)."""
        if self.lp_counts:
            if len(self.lp_counts) != len(self.token_ids):
                raise ValueError("lp_counts disagrees with token_ids")
            unpack_logprobs(self.lp_counts, self.lp_token_ids, self.lp_values)
        if self.plp_num:
            if len(self.plp_num) != len(self.token_ids):
                raise ValueError("plp_num disagrees with token_ids")
            unpack_prompt_logprobs(
                len(self.token_ids), self.plp_num, self.plp_counts, self.plp_token_ids, self.plp_values, self.plp_ranks
            )


@dataclass(slots=True)
class ExecutorOutput:
    """What one executed step returns to the scheduler, in process (`execute_model`) or decoded from
    a `StepResult`: one entry per scheduled request, in the step's order.

    ``token_ids[i]`` is the sampled token, or -1 where the request did not sample (a prefill chunk
    that does not reach the end of its tokens). ``logprobs[i]`` maps token id -> logprob (sampled
    token plus the top-N) or is None; the list is empty when no request asked for logprobs.
    ``prompt_logprobs[i]``: for a request with ``prompt_logprobs``, one entry per prompt position
    the step computed that predicts a prompt token (positions ``start .. min(end, P - 1) - 1``:
    the logprobs of prompt tokens ``start + 1 ..``), else None; empty when no request has any.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs: list[list[dict[int, float] | None] | None] = field(default_factory=list)


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
    scheduling_policy: str = "fcfs"  # `SchedulerConfig.scheduling_policy`: whether it takes priorities
    # What the prefix cache holds, for routing by it: the most recently used entries' keys
    # (`common.prefix_hash.summary_key`), packed, newest first; bounded (`scheduler.prefix_summary`).
    cached_prefixes: bytes = b""

    @property
    def load(self) -> int:
        """Routing cost: a waiting request weighs more (it still needs its prefill); vLLM's DP
        balancer uses the same ``4 x waiting + running``."""
        return 4 * self.num_waiting + self.num_running


@dataclass(slots=True)
class JournalHeader:
    """First entry of ``journal:<response>``: what a gateway needs to re-create the response.

    A response with several choices journals them all in one journal, with one header per prompt
    (the first carries the body): ``choice_ids`` are the request ids of that prompt's choices, in
    index order (empty for a response with one choice).
    """

    response_id: str
    kind: str  # "completion" | "chat"
    body: str  # the request's JSON
    served_model: str
    created: int
    max_tokens: int
    prompt_token_ids: list[int] = packed("i")
    echo_text: str | None = None
    choice_ids: list[str] = field(default_factory=list)
    tool_parser: str = ""  # the accepting gateway's output parsers ("" none): a resuming one applies them
    reasoning_parser: str = ""
    reasoning_phase: str = ""  # where the prompt left the output (the gateway's `prompt_phase`)


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
    "step": SchedulerOutput,
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
