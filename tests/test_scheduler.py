"""Scheduler logic with a scripted executor whose next token depends only on the last token and
its position, so the expected outputs are known exactly however the steps are chunked.
(The real model is exercised by tests/test_engine.py.)"""

from __future__ import annotations

import pytest

from common.batch import Batch, ExecutorOutput
from common.config import ExecutorInfo, SchedulerConfig
from common.sampling_params import SamplingParams
from scheduler.cache_manager import CacheManager
from scheduler.request import Request
from scheduler.scheduler import Scheduler

VOCAB = 97
EOS = 0


def next_token(last: int, position: int) -> int:
    return (last * 7 + position + 1) % VOCAB


class ScriptedExecutor:
    def __init__(self, num_blocks: int, block_size: int = 4, max_model_len: int = 64) -> None:
        self.info = ExecutorInfo("scripted", num_blocks, block_size, max_model_len, [EOS], VOCAB)
        self.batches: list[Batch] = []

    def execute_model(self, batch: Batch) -> ExecutorOutput:
        batch.check()
        self.batches.append(batch)
        out = ExecutorOutput()
        start = 0
        for i, q in enumerate(batch.query_lens):
            start += q
            last, pos = batch.input_ids[start - 1], batch.positions[start - 1]
            assert pos == batch.seq_lens[i] - 1
            out.token_ids.append(next_token(last, pos) if batch.sample[i] else -1)
            out.logprobs.append(None)
        return out


def expected_output(prompt: list[int], params: SamplingParams, max_model_len: int = 64) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens[-1], len(tokens) - 1)
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and ((t == EOS and not params.ignore_eos) or t in params.stop_token_ids):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, max_model_len: int = 64):
    ex = ScriptedExecutor(num_blocks, max_model_len=max_model_len)
    sched = Scheduler(SchedulerConfig(budget, max_seqs), CacheManager(num_blocks, 4), ex)
    return sched, ex


def run(sched: Scheduler, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        sched.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while sched.has_unfinished():
        for o in sched.schedule():
            got[o.request_id] += o.new_token_ids
            assert o.num_output_tokens == len(got[o.request_id])
        sched.cache.check_invariants()
    sched.cache.check_invariants()
    return got


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched, ex = make(budget=10)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = Request("a", list(range(1, 4)), params)
    b = Request("b", list(range(1, 26)), params)
    got = run(sched, [a, b])
    plans = [dict(zip(bt.request_ids, bt.query_lens)) for bt in ex.batches]
    assert plans[0] == {"a": 3, "b": 7}
    assert plans[1] == {"a": 1, "b": 9}  # a decode next to a prefill chunk
    assert plans[2] == {"a": 1, "b": 9}
    assert ex.batches[2].sample == [True, True]
    assert ex.batches[1].sample == [True, False]
    assert got["a"] == expected_output(a.prompt_token_ids, params)
    assert got["b"] == expected_output(b.prompt_token_ids, params)
    assert all(sum(p.values()) <= 10 for p in plans)


def test_max_num_seqs_and_fcfs() -> None:
    sched, ex = make(budget=100, max_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reqs = [Request(str(i), [i + 1, 2, 3], params) for i in range(5)]
    run(sched, reqs)
    for bt in ex.batches:
        assert len(bt.request_ids) <= 2
    first_seen = []
    for bt in ex.batches:
        first_seen += [r for r in bt.request_ids if r not in first_seen]
    assert first_seen == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[50, 60]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ],
)
def test_stop_conditions(params: SamplingParams) -> None:
    sched, _ = make()
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5], [3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]
    got = run(sched, [Request(str(i), p, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[str(i)] == expected_output(p, params)


def test_max_model_len_stops_with_length() -> None:
    sched, _ = make(max_model_len=20)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    r = Request("x", list(range(1, 16)), params)
    got = run(sched, [r])
    assert len(got["x"]) == 5 and r.finish_reason == "length"


def test_preemption_recomputes_to_identical_outputs() -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[i + 1] * (5 + 3 * i) for i in range(8)]
    big, _ = make(num_blocks=200, budget=32)
    small, _ = make(num_blocks=16, budget=32)  # 64 tokens: room for ~2 sequences of 34+ tokens
    want = run(big, [Request(str(i), p, params) for i, p in enumerate(prompts)])
    got = run(small, [Request(str(i), p, params) for i, p in enumerate(prompts)])
    assert big.num_preemptions == 0
    assert small.num_preemptions > 0
    assert got == want
    assert small.cache.get_num_free_blocks() == 16


def test_preempted_request_goes_to_head_of_waiting() -> None:
    sched, _ = make(num_blocks=4, budget=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a, b, c = (Request(n, [1] * 7, params) for n in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    sched.schedule()  # a and b take 2 blocks each; c waits
    sched.schedule()  # the 8th token still fits in 2 blocks
    assert [r.request_id for r in sched.running] == ["a", "b"]
    sched.schedule()  # both need a 3rd block: b (admitted last) is preempted
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.num_computed_tokens == 0 and sched.num_preemptions == 1


def test_abort_frees_blocks_at_once() -> None:
    sched, _ = make(budget=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        sched.add_request(Request(str(i), [1] * 20, params))
    sched.schedule()
    sched.schedule()
    assert sched.cache.get_num_free_blocks() < 64
    for i in range(3):
        out = sched.abort(str(i))
        assert out is not None and out.finish_reason == "abort"
    assert sched.abort("nope") is None
    assert not sched.has_unfinished()
    assert sched.cache.get_num_free_blocks() == 64
    sched.cache.check_invariants()


def test_rejects_bad_requests() -> None:
    sched, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("long", [1] * 17, SamplingParams()))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(Request("empty", [], SamplingParams()))
    sched.add_request(Request("ok", [1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(Request("ok", [1], SamplingParams()))
