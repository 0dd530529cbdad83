"""`PersistentBatch` under random add / grow / preempt / finish sequences: every step's inputs equal
those of a batch rebuilt from scratch, token by token, from a plain model of the requests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from common.protocol import SchedulerOutput
from common.sampling_params import SamplingParams
from executor.input_batch import PersistentBatch

pytestmark = pytest.mark.unit


@dataclass
class Req:
    tokens: list[int]
    num_prompt: int
    table: list[int]
    computed: int = 0


def rebuilt(reqs: dict[str, Req], plan: list[tuple[str, int]], bs: int, groups: int) -> dict[str, list]:
    """The step's inputs computed directly, one token and one block at a time."""
    out: dict[str, list] = {k: [] for k in ("input_ids", "positions", "slots", "seq_lens", "tables", "output_lens")}
    per_group: list[list[int]] = [[] for _ in range(groups)]
    width = max(-(-(reqs[r].computed + n) // bs) * groups for r, n in plan)
    for rid, n in plan:
        r = reqs[rid]
        start, end = r.computed, r.computed + n
        out["input_ids"] += r.tokens[start:end]
        out["positions"] += list(range(start, end))
        for g in range(groups):
            per_group[g] += [r.table[p // bs * groups + g] * bs + p % bs for p in range(start, end)]
        out["seq_lens"].append(end)
        used = r.table[: -(-end // bs) * groups]
        out["tables"].append(used + [0] * (width - len(used)))
        out["output_lens"].append(len(r.tokens) - r.num_prompt)
    out["slots"] = [s for g in per_group for s in g]
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("groups", [1, 2])
def test_random_sequences_match_a_rebuilt_batch(seed: int, groups: int) -> None:
    rng = random.Random(seed)
    bs, vocab = 4, 500
    state = PersistentBatch(bs, vocab, num_groups=groups)
    reqs: dict[str, Req] = {}
    next_block, next_id = 1, 0
    for step in range(1, 120):
        out = SchedulerOutput(step=step)
        # finish some
        for rid in [r for r in reqs if rng.random() < 0.08]:
            out.finished_req_ids.append(rid)
            del reqs[rid]
        # add some (a few with output already generated: migrated requests)
        for _ in range(rng.choice([0, 0, 1, 3]) if len(reqs) < 40 else 0):
            rid, next_id = f"r{next_id}", next_id + 1
            n = rng.randint(1, 30)
            tokens = [rng.randrange(vocab) for _ in range(n)]
            num_prompt = rng.randint(1, n)
            reqs[rid] = Req(tokens, num_prompt, [])
            out.add_new(rid, SamplingParams(), num_prompt, tokens, [])
        plan: list[tuple[str, int]] = []
        ids = list(reqs)
        rng.shuffle(ids)
        for rid in ids:
            r = reqs[rid]
            if rng.random() < 0.2:
                continue  # not scheduled this step
            resumed = rid not in out.new_req_ids and r.computed > 0 and rng.random() < 0.05
            if resumed:  # preempted: recomputes in a whole new table
                r.computed, r.table = 0, []
            n = min(len(r.tokens) - r.computed, rng.choice([1, 1, 2, 7]))
            if n < 1:
                continue
            need = -(-(r.computed + n) // bs) * groups
            grown = []
            while len(r.table) + len(grown) < need:
                grown.append(next_block)
                next_block += 1
            r.table += grown
            if rid in out.new_req_ids:
                i = out.new_req_ids.index(rid)
                out.new_block_ids[sum(out.new_num_blocks[:i]) : sum(out.new_num_blocks[:i])] = grown
                out.new_num_blocks[i] = len(grown)
            elif resumed or grown:
                out.add_cached(rid, resumed, r.table if resumed else grown)
            out.add_scheduled(rid, n, r.computed, r.computed + n == len(r.tokens))
            plan.append((rid, n))
        batch = state.prepare(out)
        batch.check()
        if not plan:
            continue
        want = rebuilt(reqs, plan, bs, groups)
        assert batch.request_ids == [r for r, _ in plan]
        assert batch.input_ids.tolist() == want["input_ids"]
        assert batch.positions.tolist() == want["positions"]
        assert batch.slot_mapping.tolist() == want["slots"]
        assert batch.seq_lens.tolist() == want["seq_lens"]
        assert batch.block_tables.tolist() == want["tables"]
        assert batch.output_lens.tolist() == want["output_lens"]
        assert batch.sample.tolist() == [reqs[r].computed + n == len(reqs[r].tokens) for r, n in plan]
        sampled = [rng.randrange(vocab) if s else -1 for s in batch.sample]
        state.append_sampled(batch, sampled)
        for (rid, n), token in zip(plan, sampled):
            reqs[rid].computed += n
            if token >= 0:
                reqs[rid].tokens.append(token)
        assert set(state.requests) == set(reqs)
        for rid, r in reqs.items():
            assert state.tokens(rid).tolist() == r.tokens
            assert state.table(rid).tolist() == r.table
        assert sorted(s.row for s in state.requests.values()) == list(range(len(reqs)))  # rows stay dense
    assert np.all(state.num_tokens[len(reqs) :] == 0)
