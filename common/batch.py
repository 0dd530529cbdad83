"""`Batch` (scheduler -> executor) and `ExecutorOutput` (executor -> scheduler).

Plain Python lists only: the scheduler does no tensor work; the executor turns a `Batch` into
tensors in one place. Sequences appear in the order the scheduler chose; token-level lists are the
concatenation of each sequence's new tokens in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling_params import SamplingParams


@dataclass(slots=True)
class Batch:
    """Everything one forward pass needs.

    Per token (length = total new tokens): ``input_ids``, ``positions``, ``slot_mapping``
    (``block_id * block_size + offset``; ``-1`` means "do not write").
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
class ExecutorOutput:
    """One entry per sequence of the batch, in batch order.

    ``token_ids[i]`` is the sampled token, or -1 where ``batch.sample[i]`` was False.
    ``logprobs[i]`` maps token id -> logprob (sampled token plus the top-N) or is None.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
