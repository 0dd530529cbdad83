"""The executor's persistent request state, and the `Batch` it builds from each `SchedulerOutput`.

The scheduler decides; the executor remembers. `PersistentBatch` keeps, per request, its sampling
parameters, every token it knows (the prompt, any output it was sent, then each token it sampled
itself) and its block table. A `SchedulerOutput` edits that state (drop finished, add new, grow or
replace tables) and names the step's requests; `PersistentBatch.prepare` turns it into one
`Batch`, the flat lists one forward pass needs. Plain Python: tensors are made from the `Batch`
in one place (`ModelExecutor`).

Penalties need each request's token counts. They live on the device, one row of a pool per
request with penalties (`executor.penalties.TokenCountPool`); this module only assigns the rows
(slots) and says, per step, which tokens are new to them (`TokenCountStep`), so each token is
counted once, not every step.

The state is a cache of the scheduler's: on any inconsistency it raises `ValueError`, the
executor drops everything, and the scheduler resends every request as new.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.protocol import SchedulerOutput
from common.sampling_params import SamplingParams, sampling_from_dict


@dataclass(slots=True)
class TokenCountStep:
    """One step's use of the token-count pool; only built when a sampling row has penalties.

    ``slots``: per sequence of the batch, its pool row (-1: none, or it does not sample). Before
    sampling, the ``reset`` rows (newly assigned) are zeroed, the ``prompt`` (row, token) pairs
    are marked as prompt tokens, and each ``output`` pair adds one to its token's count.
    """

    slots: list[int] = field(default_factory=list)
    reset: list[int] = field(default_factory=list)
    prompt_slots: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_slots: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """Everything one forward pass needs.

    Per token (length = total new tokens): ``input_ids``, ``positions``, ``slot_mapping``
    (``block_id * block_size + offset``).
    Per sequence (length = number of sequences): ``request_ids``, ``query_lens`` (new tokens this
    step), ``seq_lens`` (KV length after this step: cached prefix + new tokens), ``block_tables``,
    ``sample`` (False for a prefill chunk that does not reach the end of the prompt),
    ``output_lens`` (tokens generated so far: seeds per-step randomness), ``sampling_params``.
    ``token_counts``: None unless a sampling request has penalties (see `TokenCountStep`).
    ``prompt_lp``: per sequence with ``prompt_logprobs`` whose step computes prompt positions that
    predict a prompt token, ``(sequence index, how many: from its first new token, top-k)``;
    ``prompt_lp_targets``: those predicted prompt tokens, concatenated.

    KV-cache groups (a hybrid model, ``num_groups`` G > 1, see `executor.kv_groups`): each
    ``block_tables`` entry is the groups' tables interleaved (entry ``i * G + g``: group g's block
    i), and ``slot_mapping`` holds G rows of ``num_tokens``, group by group.
    """

    request_ids: list[str] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    sampling_params: list[SamplingParams] = field(default_factory=list)
    token_counts: TokenCountStep | None = None
    prompt_lp: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_lp_targets: list[int] = field(default_factory=list)
    num_groups: int = 1

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def check(self) -> None:
        """Assert the shape invariants stated in the docstring."""
        n = self.num_seqs
        assert len(self.query_lens) == len(self.seq_lens) == len(self.block_tables) == n
        assert len(self.sample) == len(self.output_lens) == len(self.sampling_params) == n
        assert sum(self.query_lens) == self.num_tokens == len(self.positions)
        assert len(self.slot_mapping) == self.num_tokens * self.num_groups
        assert all(q >= 1 and s >= q for q, s in zip(self.query_lens, self.seq_lens))
        assert self.token_counts is None or len(self.token_counts.slots) == n


@dataclass(slots=True)
class CachedRequestState:
    """One request as the executor holds it between steps."""

    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    count_slot: int = -1  # its row of the token-count pool (penalties only); -1 until it first samples
    num_counted: int = 0  # output tokens already counted in that row
    grammar: Any = None  # its `executor.grammar.GrammarState` (structured outputs), made on first sampling
    allowed: Any = None  # its ``allowed_token_ids`` on the device (`executor.sampler`), made on first sampling
    bad_words: Any = None  # its `executor.penalties.BadWords`, made on first sampling


class PersistentBatch:
    """Per-request state that outlives steps; builds each step's `Batch` (see the module doc)."""

    def __init__(self, block_size: int, vocab_size: int | None = None, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.num_groups = num_groups  # KV-cache groups: tables interleave them (see `Batch`)
        self.requests: dict[str, CachedRequestState] = {}
        # Token-count pool rows: freed ones for reuse, and the next never used (the pool's size).
        self.free_slots: list[int] = []
        self.num_slots = 0

    def clear(self) -> None:
        self.requests.clear()
        self.free_slots.clear()
        self.num_slots = 0

    def _drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.count_slot >= 0:
            self.free_slots.append(state.count_slot)

    def prepare(self, output: SchedulerOutput) -> Batch:
        """Apply ``output``'s edits and return the step's batch; `ValueError` if inconsistent."""
        for request_id in output.finished_req_ids:
            self._drop(request_id)
        vocab = self.vocab_size
        for new in output.new_requests():
            tokens = new.token_ids
            if vocab is not None and tokens and not (0 <= min(tokens) and max(tokens) < vocab):
                raise ValueError(f"request {new.request_id!r}: token ids must be in [0, {vocab})")
            if not 0 < new.num_prompt_tokens <= len(tokens):
                raise ValueError(f"request {new.request_id!r}: {new.num_prompt_tokens} prompt tokens of {len(tokens)}")
            try:
                params = sampling_from_dict(new.sampling)
            except TypeError as exc:  # an unknown field: a bad step, as any other (`ValueError`)
                raise ValueError(f"request {new.request_id!r}: {exc}") from None
            self._drop(new.request_id)
            self.requests[new.request_id] = CachedRequestState(params, new.num_prompt_tokens, tokens, new.block_ids)
        for request_id, resumed, block_ids in output.cached_requests():
            state = self._state(request_id)
            if resumed:
                state.block_ids = block_ids
            else:
                state.block_ids.extend(block_ids)
        n = output.num_seqs
        if not len(output.num_scheduled_tokens) == len(output.num_computed_tokens) == n:
            raise ValueError("scheduled-request columns differ in length")
        bs, groups = self.block_size, self.num_groups
        batch = Batch(num_groups=groups)
        group_slots: list[list[int]] = [[] for _ in range(groups if groups > 1 else 0)]
        for i, request_id in enumerate(output.scheduled_req_ids):
            state = self._state(request_id)
            q, start = output.num_scheduled_tokens[i], output.num_computed_tokens[i]
            end = start + q
            tokens, table = state.token_ids, state.block_ids
            if q < 1 or start < 0 or end > len(tokens) or -(-end // bs) * groups > len(table):
                raise ValueError(
                    f"request {request_id!r}: positions [{start}, {end}) but {len(tokens)} tokens "
                    f"and {len(table)} blocks are known"
                )
            batch.request_ids.append(request_id)
            batch.input_ids.extend(tokens[start:end])
            batch.positions.extend(range(start, end))
            if groups == 1:
                batch.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            else:
                for g, slots in enumerate(group_slots):
                    slots.extend(table[p // bs * groups + g] * bs + p % bs for p in range(start, end))
            batch.query_lens.append(q)
            batch.seq_lens.append(end)
            batch.block_tables.append(list(table))  # the batch must not change with later steps
            batch.sample.append(end == len(tokens))
            batch.output_lens.append(len(tokens) - state.num_prompt_tokens)
            batch.sampling_params.append(state.params)
            top = state.params.prompt_logprobs
            last = min(end, state.num_prompt_tokens - 1)  # position P - 1 predicts the first output token
            if top is not None and last > start:
                batch.prompt_lp.append((i, last - start, top))
                batch.prompt_lp_targets.extend(tokens[start + 1 : last + 1])
            if end == len(tokens) and state.params.penalized:
                if batch.token_counts is None:
                    batch.token_counts = TokenCountStep(slots=[-1] * i)
                batch.token_counts.slots.append(self._count(state, batch.token_counts))
            elif batch.token_counts is not None:
                batch.token_counts.slots.append(-1)
        for slots in group_slots:
            batch.slot_mapping.extend(slots)
        return batch

    def _count(self, state: CachedRequestState, step: TokenCountStep) -> int:
        """``state``'s pool row, assigned on first use; its tokens not counted yet go into ``step``."""
        slot = state.count_slot
        if slot < 0:
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                slot, self.num_slots = self.num_slots, self.num_slots + 1
            state.count_slot, state.num_counted = slot, 0
            step.reset.append(slot)
            if state.params.repetition_penalty != 1.0:  # the only reader of the prompt marks
                prompt = state.token_ids[: state.num_prompt_tokens]
                step.prompt_slots.extend([slot] * len(prompt))
                step.prompt_tokens.extend(prompt)
        new = state.token_ids[state.num_prompt_tokens + state.num_counted :]
        step.output_slots.extend([slot] * len(new))
        step.output_tokens.extend(new)
        state.num_counted += len(new)
        return slot

    def append_sampled(self, batch: Batch, token_ids: list[int]) -> None:
        """Each sampling request of ``batch`` takes its new token (read by the next step)."""
        for request_id, sampled, token in zip(batch.request_ids, batch.sample, token_ids):
            if sampled:
                self.requests[request_id].token_ids.append(token)

    def _state(self, request_id: str) -> CachedRequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise ValueError(f"step refers to unknown request {request_id!r}")
        return state
