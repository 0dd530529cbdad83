"""The executor's persistent request state, and the `Batch` it builds from each `SchedulerOutput`.

The scheduler decides; the executor remembers. `PersistentBatch` keeps its requests as rows of
preallocated arrays (vLLM's ``InputBatch``): every token each request knows (the prompt, any output
it was sent, then each token it sampled itself) in one 2D array, block tables in another, counts and
sampling parameters as columns. A `SchedulerOutput` edits rows (finished ones removed, the last row
moved into the hole; new ones added; tables grown or replaced), never rebuilding them, and names
the step's requests; `PersistentBatch.prepare` gathers their rows and computes the step's inputs
(input ids, positions, slot mapping, sequence lengths) with array operations, no Python loop over
tokens or blocks. Tensors are made from the `Batch` in one place (`ModelExecutor`).

One decision per fact: how many tokens a row schedules, its first position, and whether it samples
come from the scheduler and are taken as given; a row that samples takes its token at the position
after its last scheduled one (`PersistentBatch.append_sampled`).

Penalties need each request's token counts. They live on the device, one row of a pool per
request with penalties (`executor.penalties.TokenCountPool`); this module only assigns the rows
(slots) and says, per step, which tokens are new to them (`TokenCountStep`), so each token is
counted once, not every step.

The state is a cache of the scheduler's: on any inconsistency it raises `ValueError`, the
executor drops everything, and the scheduler resends every request as new.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.protocol import SchedulerOutput
from common.sampling_params import SamplingParams, sampling_from_dict

# Rows and token columns the arrays start with; each grows (doubling) when a step needs more.
INITIAL_ROWS = 16
INITIAL_TOKENS = 256


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


def _ints(values: Any, dtype: type = np.int64) -> np.ndarray:
    return np.asarray(values, dtype=dtype).reshape(-1)


def padded_tables(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Block tables of different lengths as one int32 array, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


@dataclass(slots=True)
class Batch:
    """Everything one forward pass needs.

    Per token (numpy, length = total new tokens): ``input_ids``, ``positions``, ``slot_mapping``
    (``block_id * block_size + offset``).
    Per sequence (length = number of sequences): ``request_ids``, ``query_lens`` (new tokens this
    step), ``seq_lens`` (KV length after this step: cached prefix + new tokens), ``block_tables``
    (one int32 row per sequence, as wide as the longest needs, padded with block 0), ``sample``
    (whether it samples a token: the scheduler's word), ``output_lens`` (tokens generated so far:
    seeds per-step randomness), ``sampling_params``.
    ``token_counts``: None unless a sampling request has penalties (see `TokenCountStep`).
    ``prompt_lp``: per sequence with ``prompt_logprobs`` whose step computes prompt positions that
    predict a prompt token, ``(sequence index, how many: from its first new token, top-k)``;
    ``prompt_lp_targets``: those predicted prompt tokens, concatenated.
    ``rows``: each sequence's row of the `PersistentBatch` that built it (empty for a hand-built one).
    ``plain``: every sampling row is greedy and asks for nothing else (no logprobs, constraints,
    biases, penalties or grammar), so sampling is one argmax.

    KV-cache groups (a hybrid model, ``num_groups`` G > 1, see `executor.kv_groups`): each
    ``block_tables`` row is the groups' tables interleaved (entry ``i * G + g``: group g's block
    i), and ``slot_mapping`` holds G rows of ``num_tokens``, group by group.

    Built by hand (tests), lists are accepted and turned into arrays here.
    """

    request_ids: list[str] = field(default_factory=list)
    input_ids: Any = field(default_factory=list)
    positions: Any = field(default_factory=list)
    slot_mapping: Any = field(default_factory=list)
    query_lens: Any = field(default_factory=list)
    seq_lens: Any = field(default_factory=list)
    block_tables: Any = field(default_factory=list)
    sample: Any = field(default_factory=list)
    output_lens: Any = field(default_factory=list)
    sampling_params: list[SamplingParams] = field(default_factory=list)
    token_counts: TokenCountStep | None = None
    prompt_lp: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_lp_targets: list[int] = field(default_factory=list)
    num_groups: int = 1
    rows: Any = field(default_factory=list)
    plain: bool = False

    def __post_init__(self) -> None:
        self.input_ids = _ints(self.input_ids)
        self.positions = _ints(self.positions)
        self.slot_mapping = _ints(self.slot_mapping)
        self.query_lens = _ints(self.query_lens)
        self.seq_lens = _ints(self.seq_lens)
        self.output_lens = _ints(self.output_lens)
        self.sample = np.asarray(self.sample, dtype=bool).reshape(-1)
        self.rows = _ints(self.rows)
        if not isinstance(self.block_tables, np.ndarray):
            self.block_tables = padded_tables(self.block_tables)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def check(self) -> None:
        """Assert the shape invariants stated in the docstring."""
        n = self.num_seqs
        assert len(self.query_lens) == len(self.seq_lens) == self.block_tables.shape[0] == n
        assert len(self.sample) == len(self.output_lens) == len(self.sampling_params) == n
        assert int(self.query_lens.sum()) == self.num_tokens == len(self.positions)
        assert len(self.slot_mapping) == self.num_tokens * self.num_groups
        assert bool((self.query_lens >= 1).all()) and bool((self.seq_lens >= self.query_lens).all())
        assert self.token_counts is None or len(self.token_counts.slots) == n


def _plain(p: SamplingParams) -> bool:
    """Whether sampling ``p`` is one argmax (see `Batch`)."""
    return (
        p.greedy
        and p.logprobs is None
        and not (p.min_tokens or p.bad_words_token_ids or p.logit_bias or p.penalized)
        and p.allowed_token_ids is None
        and p.structured_outputs is None
    )


@dataclass(slots=True)
class CachedRequestState:
    """One request as the executor holds it between steps (its tokens and table: its ``row``)."""

    params: SamplingParams
    num_prompt_tokens: int
    owner: PersistentBatch
    row: int = -1
    count_slot: int = -1  # its row of the token-count pool (penalties only); -1 until it first samples
    num_counted: int = 0  # output tokens already counted in that row
    grammar: Any = None  # its `executor.grammar.GrammarState` (structured outputs), made on first sampling
    allowed: Any = None  # its ``allowed_token_ids`` on the device (`executor.sampler`), made on first sampling
    bad_words: Any = None  # its `executor.penalties.BadWords`, made on first sampling

    @property
    def token_ids(self) -> list[int]:
        """Every token it holds (a copy: for the few readers that walk them, grammars, bad words)."""
        return self.owner.token_ids[self.row, : self.owner.num_tokens[self.row]].tolist()


class PersistentBatch:
    """Per-request state that outlives steps, as rows of arrays; builds each step's `Batch`.

    Rows ``0 .. len(requests) - 1`` are live. ``token_ids[row, :num_tokens[row]]`` are a request's
    tokens, ``block_table[row, :num_blocks[row]]`` its table (zero past it); ``penalized`` and
    ``prompt_lp`` are per-row flags of its sampling parameters, ``row_ids`` its id, ``row_uid`` a
    number no other request added to this batch has had (a sampled token still on the device names
    its request by it, since rows move: `rows_of`).
    """

    def __init__(self, block_size: int, vocab_size: int | None = None, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.num_groups = num_groups  # KV-cache groups: tables interleave them (see `Batch`)
        self.requests: dict[str, CachedRequestState] = {}
        self.row_ids: list[str] = []
        self.token_ids = np.zeros((INITIAL_ROWS, INITIAL_TOKENS), dtype=np.int32)
        self.block_table = np.zeros((INITIAL_ROWS, -(-INITIAL_TOKENS // block_size) * num_groups), dtype=np.int32)
        self.num_tokens = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self.num_prompt = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self.num_blocks = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self.penalized = np.zeros(INITIAL_ROWS, dtype=bool)
        self.prompt_lp = np.zeros(INITIAL_ROWS, dtype=bool)
        self.plain = np.zeros(INITIAL_ROWS, dtype=bool)
        self.row_uid = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self.next_uid = 0
        self.layout = 0  # counts the edits that move or remove rows: rows noted before it stay valid
        # Token-count pool rows: freed ones for reuse, and the next never used (the pool's size).
        self.free_slots: list[int] = []
        self.num_slots = 0

    def clear(self) -> None:
        self.layout += 1
        self.requests.clear()
        self.row_ids.clear()
        self.token_ids[:] = 0
        self.block_table[:] = 0
        self.num_tokens[:] = 0
        self.num_blocks[:] = 0
        self.free_slots.clear()
        self.num_slots = 0

    def tokens(self, request_id: str) -> np.ndarray:
        """Every token ``request_id`` holds (a view: valid until the next edit)."""
        row = self.requests[request_id].row
        return self.token_ids[row, : self.num_tokens[row]]

    def table(self, request_id: str) -> np.ndarray:
        """``request_id``'s block table (a view: valid until the next edit)."""
        row = self.requests[request_id].row
        return self.block_table[row, : self.num_blocks[row]]

    # -- row edits ---------------------------------------------------------------------------
    def _reserve(self, rows: int, tokens: int, blocks: int) -> None:
        """Grow the arrays (doubling) to at least ``rows`` rows, ``tokens`` and ``blocks`` columns."""
        r, t = self.token_ids.shape
        b = self.block_table.shape[1]
        if rows > r:
            new_r = max(rows, 2 * r)
            for name in ("num_tokens", "num_prompt", "num_blocks", "penalized", "prompt_lp", "plain", "row_uid"):
                old = getattr(self, name)
                grown = np.zeros(new_r, dtype=old.dtype)
                grown[:r] = old
                setattr(self, name, grown)
            r = new_r
        if rows > self.token_ids.shape[0] or tokens > t:
            grown_t = np.zeros((r, max(tokens, 2 * t) if tokens > t else t), dtype=np.int32)
            grown_t[: self.token_ids.shape[0], :t] = self.token_ids
            self.token_ids = grown_t
        if rows > self.block_table.shape[0] or blocks > b:
            grown_b = np.zeros((r, max(blocks, 2 * b) if blocks > b else b), dtype=np.int32)
            grown_b[: self.block_table.shape[0], :b] = self.block_table
            self.block_table = grown_b

    def _drop(self, request_id: str) -> None:
        """Remove a request's row; the last row moves into its place (rows stay dense)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.layout += 1
        if state.count_slot >= 0:
            self.free_slots.append(state.count_slot)
        row, last = state.row, len(self.row_ids) - 1
        if row != last:
            moved = self.row_ids[last]
            self.row_ids[row] = moved
            self.requests[moved].row = row
            nt, nb = self.num_tokens[last], self.num_blocks[last]
            self.token_ids[row, :nt] = self.token_ids[last, :nt]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.block_table[row, nb : self.num_blocks[row]] = 0
            for col in (
                self.num_tokens,
                self.num_prompt,
                self.num_blocks,
                self.penalized,
                self.prompt_lp,
                self.plain,
                self.row_uid,
            ):
                col[row] = col[last]
        self.row_ids.pop()
        self.block_table[last, : self.num_blocks[last]] = 0
        self.num_tokens[last] = self.num_blocks[last] = 0

    def _add(self, request_id: str, params: SamplingParams, num_prompt: int, tokens: np.ndarray, blocks: np.ndarray) -> None:
        row = len(self.row_ids)
        self._reserve(row + 1, len(tokens) + 1, len(blocks))
        self.row_ids.append(request_id)
        self.requests[request_id] = CachedRequestState(params, num_prompt, self, row)
        self.token_ids[row, : len(tokens)] = tokens
        self.block_table[row, : len(blocks)] = blocks
        self.num_tokens[row], self.num_prompt[row], self.num_blocks[row] = len(tokens), num_prompt, len(blocks)
        self.penalized[row] = params.penalized
        self.prompt_lp[row] = params.prompt_logprobs is not None
        self.plain[row] = _plain(params)
        self.row_uid[row], self.next_uid = self.next_uid, self.next_uid + 1

    def _set_table(self, row: int, blocks: np.ndarray, replace: bool) -> None:
        old = int(self.num_blocks[row])
        at = 0 if replace else old
        self._reserve(0, 0, at + len(blocks))
        self.block_table[row, at : at + len(blocks)] = blocks
        if replace and len(blocks) < old:
            self.block_table[row, len(blocks) : old] = 0
        self.num_blocks[row] = at + len(blocks)

    def _apply(self, output: SchedulerOutput) -> None:
        """The edits of ``output``: finished requests dropped, new ones added, tables updated."""
        for request_id in output.finished_req_ids:
            self._drop(request_id)
        vocab = self.vocab_size
        new_tokens = np.asarray(output.new_token_ids, dtype=np.int64)
        if vocab is not None and len(new_tokens) and not (new_tokens.min() >= 0 and new_tokens.max() < vocab):
            bad = next(
                r.request_id
                for r in output.new_requests()
                if r.token_ids and not 0 <= min(r.token_ids) <= max(r.token_ids) < vocab
            )
            raise ValueError(f"request {bad!r}: token ids must be in [0, {vocab})")
        for new in output.new_requests():
            tokens = new.token_ids
            if not 0 < new.num_prompt_tokens <= len(tokens):
                raise ValueError(f"request {new.request_id!r}: {new.num_prompt_tokens} prompt tokens of {len(tokens)}")
            try:
                params = sampling_from_dict(new.sampling)
            except TypeError as exc:  # an unknown field: a bad step, as any other (`ValueError`)
                raise ValueError(f"request {new.request_id!r}: {exc}") from None
            self._drop(new.request_id)
            self._add(new.request_id, params, new.num_prompt_tokens, np.asarray(tokens), np.asarray(new.block_ids))
        for request_id, resumed, block_ids in output.cached_requests():
            self._set_table(self._state(request_id).row, np.asarray(block_ids, dtype=np.int32), resumed)

    def prepare(self, output: SchedulerOutput) -> Batch:
        """Apply ``output``'s edits and return the step's batch; `ValueError` if inconsistent."""
        self._apply(output)
        n = output.num_seqs
        if not len(output.num_scheduled_tokens) == len(output.num_computed_tokens) == len(output.sample) == n:
            raise ValueError("scheduled-request columns differ in length")
        requests = self.requests
        try:
            rows = np.fromiter((requests[r].row for r in output.scheduled_req_ids), dtype=np.int64, count=n)
        except KeyError as exc:
            raise ValueError(f"step refers to unknown request {exc.args[0]!r}") from None
        q = np.asarray(output.num_scheduled_tokens, dtype=np.int64)
        start = np.asarray(output.num_computed_tokens, dtype=np.int64)
        sample = np.asarray(output.sample, dtype=bool)
        end = start + q
        bs, groups = self.block_size, self.num_groups
        need = -(-end // bs) * groups  # table entries the step reads
        known = self.num_tokens[rows]
        bad = (q < 1) | (start < 0) | (end > known) | (need > self.num_blocks[rows])
        if n and bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"request {output.scheduled_req_ids[i]!r}: positions [{start[i]}, {end[i]}) but {known[i]} tokens "
                f"and {self.num_blocks[rows[i]]} blocks are known"
            )
        self._reserve(0, int(end.max(initial=0)) + 1, 0)  # room for the tokens sampled at ``end``
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        total = int(qsl[-1])
        tok_rows = np.repeat(rows, q)
        positions = np.arange(total, dtype=np.int64) + np.repeat(start - qsl[:-1], q)
        input_ids = self.token_ids[tok_rows, positions].astype(np.int64)
        block_index, offset = np.divmod(positions, bs)
        if groups == 1:
            slot_mapping = self.block_table[tok_rows, block_index].astype(np.int64) * bs + offset
        else:
            slot_mapping = np.concatenate(
                [self.block_table[tok_rows, block_index * groups + g].astype(np.int64) * bs + offset for g in range(groups)]
            )
        width = max(int(need.max(initial=0)), groups)
        tables = self.block_table[rows, :width]  # a copy: later steps do not change it
        tables[np.arange(width) >= need[:, None]] = 0  # only the blocks the step reads
        batch = Batch(
            request_ids=list(output.scheduled_req_ids),
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_lens=q,
            seq_lens=end,
            block_tables=tables,
            sample=sample,
            output_lens=known - self.num_prompt[rows],
            sampling_params=[requests[r].params for r in output.scheduled_req_ids],
            num_groups=groups,
            rows=rows,
            plain=bool(self.plain[rows].all()),
        )
        for i in np.flatnonzero(self.prompt_lp[rows]).tolist():
            state = requests[output.scheduled_req_ids[i]]
            top = state.params.prompt_logprobs
            s, e = int(start[i]), int(end[i])
            last = min(e, state.num_prompt_tokens - 1)  # position P - 1 predicts the first output token
            if top is not None and last > s:
                batch.prompt_lp.append((i, last - s, top))
                batch.prompt_lp_targets.extend(self.token_ids[rows[i], s + 1 : last + 1].tolist())
        counted = np.flatnonzero(sample & self.penalized[rows])
        if len(counted):
            step = batch.token_counts = TokenCountStep(slots=[-1] * n)
            for i in counted.tolist():
                step.slots[i] = self._count(requests[output.scheduled_req_ids[i]], step)
        return batch

    def _count(self, state: CachedRequestState, step: TokenCountStep) -> int:
        """``state``'s pool row, assigned on first use; its tokens not counted yet go into ``step``."""
        slot = state.count_slot
        row, p = state.row, state.num_prompt_tokens
        if slot < 0:
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                slot, self.num_slots = self.num_slots, self.num_slots + 1
            state.count_slot, state.num_counted = slot, 0
            step.reset.append(slot)
            if state.params.repetition_penalty != 1.0:  # the only reader of the prompt marks
                step.prompt_slots.extend([slot] * p)
                step.prompt_tokens.extend(self.token_ids[row, :p].tolist())
        new = self.token_ids[row, p + state.num_counted : self.num_tokens[row]].tolist()
        step.output_slots.extend([slot] * len(new))
        step.output_tokens.extend(new)
        state.num_counted += len(new)
        return slot

    def append_sampled(self, batch: Batch, token_ids: Sequence[int] | np.ndarray) -> None:
        """Each sampling row of ``batch`` takes its new token at the position after its last
        scheduled one (read by the next step); what it held past there is dropped. ``token_ids``
        (one per sequence) may hold placeholders for tokens not read back yet (`fill_sampled`)."""
        sel = batch.sample
        rows, at = batch.rows[sel], batch.seq_lens[sel]
        self.token_ids[rows, at] = np.asarray(token_ids, dtype=np.int64)[sel]
        self.num_tokens[rows] = at + 1

    def rows_of(self, uids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``uids``: the row that holds it now, and whether one does (a request dropped
        since has none; its row entry is then meaningless)."""
        live = self.row_uid[: len(self.row_ids)]
        if not len(live) or not len(uids):
            return np.zeros(len(uids), dtype=np.int64), np.zeros(len(uids), dtype=bool)
        order = np.argsort(live)
        pos = np.minimum(np.searchsorted(live[order], uids), len(live) - 1)
        rows = order[pos]
        return rows, live[rows] == uids

    def fill_sampled(self, uids: np.ndarray, at: np.ndarray, token_ids: np.ndarray, rows: np.ndarray, layout: int) -> None:
        """Tokens sampled by a step whose tokens were left on the device (`append_sampled` held
        their places): each goes to position ``at`` of request ``uids``, if that request is still
        here and still holds that position (a later edit may have dropped it). ``rows``: theirs
        when ``layout`` was current (looked up again only if rows moved since)."""
        if layout == self.layout:
            ok = np.ones(len(rows), dtype=bool)
        else:
            rows, ok = self.rows_of(uids)
        ok &= at < self.num_tokens[rows]
        self.token_ids[rows[ok], at[ok]] = token_ids[ok]

    def _state(self, request_id: str) -> CachedRequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise ValueError(f"step refers to unknown request {request_id!r}")
        return state
