"""The executor's persistent request state, and the `Batch` it builds from each `SchedulerOutput`.

The scheduler decides; the executor remembers. `PersistentBatch` keeps, per request, its sampling
parameters, every token it knows (the prompt, any output it was sent, then each token it sampled
itself) and its block table. A `SchedulerOutput` edits that state (drop finished, add new, grow or
replace tables) and names the step's requests; `PersistentBatch.prepare` turns it into one
`Batch`, the flat lists one forward pass needs. Plain Python: tensors are made from the `Batch`
in one place (`ModelExecutor`).

The state is a cache of the scheduler's: on any inconsistency it raises `ValueError`, the
executor drops everything, and the scheduler resends every request as new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import SchedulerOutput
from common.sampling_params import SamplingParams


@dataclass(slots=True)
class Batch:
    """Everything one forward pass needs.

    Per token (length = total new tokens): ``input_ids``, ``positions``, ``slot_mapping``
    (``block_id * block_size + offset``).
    Per sequence (length = number of sequences): ``request_ids``, ``query_lens`` (new tokens this
    step), ``seq_lens`` (KV length after this step: cached prefix + new tokens), ``block_tables``,
    ``sample`` (False for a prefill chunk that does not reach the end of the prompt),
    ``output_lens`` (tokens generated so far: seeds per-step randomness), ``sampling_params``.
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
        assert sum(self.query_lens) == self.num_tokens == len(self.positions) == len(self.slot_mapping)
        assert all(q >= 1 and s >= q for q, s in zip(self.query_lens, self.seq_lens))


@dataclass(slots=True)
class CachedRequestState:
    """One request as the executor holds it between steps."""

    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]
    block_ids: list[int]


class PersistentBatch:
    """Per-request state that outlives steps; builds each step's `Batch` (see the module doc)."""

    def __init__(self, block_size: int, vocab_size: int | None = None) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.requests: dict[str, CachedRequestState] = {}

    def clear(self) -> None:
        self.requests.clear()

    def prepare(self, output: SchedulerOutput) -> Batch:
        """Apply ``output``'s edits and return the step's batch; `ValueError` if inconsistent."""
        for request_id in output.finished_req_ids:
            self.requests.pop(request_id, None)
        vocab = self.vocab_size
        for new in output.new_requests():
            tokens = new.token_ids
            if vocab is not None and tokens and not (0 <= min(tokens) and max(tokens) < vocab):
                raise ValueError(f"request {new.request_id!r}: token ids must be in [0, {vocab})")
            if not 0 < new.num_prompt_tokens <= len(tokens):
                raise ValueError(f"request {new.request_id!r}: {new.num_prompt_tokens} prompt tokens of {len(tokens)}")
            self.requests[new.request_id] = CachedRequestState(SamplingParams(**new.sampling), new.num_prompt_tokens,
                                                               tokens, new.block_ids)
        for request_id, resumed, block_ids in output.cached_requests():
            state = self._state(request_id)
            if resumed:
                state.block_ids = block_ids
            else:
                state.block_ids.extend(block_ids)
        n = output.num_seqs
        if not len(output.num_scheduled_tokens) == len(output.num_computed_tokens) == n:
            raise ValueError("scheduled-request columns differ in length")
        bs = self.block_size
        batch = Batch()
        for i, request_id in enumerate(output.scheduled_req_ids):
            state = self._state(request_id)
            q, start = output.num_scheduled_tokens[i], output.num_computed_tokens[i]
            end = start + q
            tokens, table = state.token_ids, state.block_ids
            if q < 1 or start < 0 or end > len(tokens) or -(-end // bs) > len(table):
                raise ValueError(f"request {request_id!r}: positions [{start}, {end}) but {len(tokens)} tokens "
                                 f"and {len(table)} blocks are known")
            batch.request_ids.append(request_id)
            batch.input_ids.extend(tokens[start:end])
            batch.positions.extend(range(start, end))
            batch.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            batch.query_lens.append(q)
            batch.seq_lens.append(end)
            batch.block_tables.append(list(table))  # the batch must not change with later steps
            batch.sample.append(end == len(tokens))
            batch.output_lens.append(len(tokens) - state.num_prompt_tokens)
            batch.sampling_params.append(state.params)
        return batch

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
