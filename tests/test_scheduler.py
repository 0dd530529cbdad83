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


# -- faults: a new executor, and isolating the request that fails a step ---------------------------
def step_plans(ex: ScriptedExecutor, start: int = 0) -> list[dict[str, int]]:
    return [dict(zip(bt.request_ids, bt.query_lens)) for bt in ex.batches[start:]]


def collect(sched: Scheduler, got: dict[str, list[int]], steps: int | None = None) -> None:
    """Run ``steps`` steps (None: to the end), appending each request's new tokens to ``got``."""
    n = 0
    while sched.has_unfinished() and (steps is None or n < steps):
        for o in sched.schedule():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.num_output_tokens == len(got[o.request_id])
        sched.cache.check_invariants()
        n += 1


def test_reset_executor_moves_everything_and_continues_identically() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6], "c": [5, 3, 5, 8, 9, 7, 9], "d": [2, 7]}
    sched, old_ex = make(num_blocks=64, budget=32, max_seqs=3)
    old_cache = sched.cache
    reqs = {rid: Request(rid, p, params) for rid, p in prompts.items()}
    for r in reqs.values():
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    collect(sched, got, steps=3)
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert running == ["a", "b", "c"] and waiting == ["d"]
    assert all(reqs[r].num_computed_tokens > 0 for r in running)
    assert old_cache.get_num_free_blocks() < 64
    preemptions = sched.num_preemptions

    new_ex = ScriptedExecutor(32, max_model_len=48)
    new_cache = CacheManager(32, 4)
    sched.reset_executor(new_ex, new_cache)

    # Everything waits, running requests first and in their order, with nothing computed.
    assert sched.running == [] and [r.request_id for r in sched.waiting] == running + waiting
    assert all(r.num_computed_tokens == 0 for r in reqs.values())
    assert all(reqs[r].num_preemptions == 1 for r in running) and reqs["d"].num_preemptions == 0
    assert sched.num_preemptions == preemptions + len(running)
    # The old pool got every block back; the new one is untouched until the next step.
    assert old_cache.get_num_free_blocks() == 64 and old_cache.block_tables == {}
    old_cache.check_invariants()
    assert sched.cache is new_cache and sched.executor is new_ex and new_cache.get_num_free_blocks() == 32
    assert sched.max_model_len == 48
    # Tokens generated so far are kept: the first new step recomputes prompt + output from 0.
    kept = {r: list(reqs[r].output_token_ids) for r in prompts}
    assert kept == {r: got.get(r, []) for r in prompts}
    n_old_batches = len(old_ex.batches)
    collect(sched, got)
    assert len(old_ex.batches) == n_old_batches  # the old executor is never called again
    first = new_ex.batches[0]
    for rid in running:
        i = first.request_ids.index(rid)
        assert first.positions[sum(first.query_lens[:i])] == 0
    # And generation goes on exactly as without the fault.
    for rid, prompt in prompts.items():
        assert got[rid] == expected_output(prompt, params)
        assert reqs[rid].finish_reason == "length"
    assert new_cache.get_num_free_blocks() == 32 and old_cache.get_num_free_blocks() == 64


def test_preempt_all_keeps_order_ahead_of_waiting() -> None:
    sched, _ = make(budget=64, max_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for rid in "xyz":
        sched.add_request(Request(rid, [1, 2, 3], params))
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["x", "y"]
    sched.preempt_all()
    assert sched.running == [] and [r.request_id for r in sched.waiting] == ["x", "y", "z"]
    assert sched.cache.get_num_free_blocks() == 64
    sched.cache.check_invariants()


def test_isolate_runs_one_suspect_per_step_until_each_passed() -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9], "d": [3, 3, 3]}
    sched, ex = make(budget=64)
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, params))
    got: dict[str, list[int]] = {}
    collect(sched, got, steps=2)
    # A step with a, b, c, d failed: the executor dropped its state, so everything is recomputed.
    sched.preempt_all()
    sched.isolate(["c", "ghost", "a", "b"])  # unknown ids are ignored; d is not a suspect
    assert sched.suspects == ["c", "a", "b"]
    mark = len(ex.batches)
    collect(sched, got, steps=3)
    # One suspect per step, in the order given, each recomputed but for what the prefix cache
    # holds: whole blocks (of 4) that earlier, successful steps filled, never the last token.
    redo = {rid: len(p) + 2 - 4 * ((len(p) + 1) // 4) for rid, p in prompts.items()}
    assert redo == {"a": 1, "b": 2, "c": 4, "d": 1}
    assert step_plans(ex, mark) == [{"c": redo["c"]}, {"a": redo["a"]}, {"b": redo["b"]}]
    assert sched.suspects == []
    # Then normal batching again: everyone in one step.
    collect(sched, got, steps=1)
    assert set(step_plans(ex, mark + 3)[0]) == {"a", "b", "c", "d"}
    collect(sched, got)
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, params)


def test_isolate_a_running_request_leaves_the_others_their_blocks() -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sched, ex = make(budget=64)
    for rid in "ab":
        sched.add_request(Request(rid, [1, 2, 3, 4, 5], params))
    got: dict[str, list[int]] = {}
    collect(sched, got, steps=2)
    table_a = list(sched.cache.get_block_table("a"))
    sched.isolate(["b"])
    collect(sched, got, steps=1)
    assert step_plans(ex)[-1] == {"b": 1}  # a decode, alone
    assert sched.cache.get_block_table("a") == table_a and sched.requests["a"].num_computed_tokens == 6
    collect(sched, got, steps=1)
    assert step_plans(ex)[-1] == {"a": 1, "b": 1}
    collect(sched, got)
    assert got["a"] == got["b"] == expected_output([1, 2, 3, 4, 5], params)


class FailingExecutor(ScriptedExecutor):
    """Fails every step that includes the request ``bad``."""

    def execute_model(self, batch: Batch) -> ExecutorOutput:
        if "bad" in batch.request_ids:
            self.batches.append(batch)
            raise RuntimeError("illegal memory access")
        return super().execute_model(batch)


def test_isolation_finds_the_culprit_which_fails_with_error() -> None:
    """What the scheduler service does on a failed step, with a request that always breaks it."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = {"a": [1, 2, 3], "bad": [4, 5], "c": [6, 7, 8, 9]}
    ex = FailingExecutor(64)
    sched = Scheduler(SchedulerConfig(64, 8), CacheManager(64, 4), ex)
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, params))
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    failures = 0
    while sched.has_unfinished():
        try:
            outputs = sched.schedule()
        except RuntimeError:
            failures += 1
            ids = ex.batches[-1].request_ids
            sched.preempt_all()
            if len(ids) == 1:
                out = sched.abort(ids[0], "error")
                assert out is not None and out.finished and out.finish_reason == "error"
                finished[ids[0]] = out.finish_reason
            else:
                sched.isolate(ids)
            sched.cache.check_invariants()
            continue
        for o in outputs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert failures == 2  # the batch, then "bad" alone
    assert step_plans(ex)[:3] == [{"a": 3, "bad": 2, "c": 4}, {"a": 3}, {"bad": 2}]
    assert finished == {"a": "length", "bad": "error", "c": "length"}
    assert "bad" not in got and got["a"] == expected_output(prompts["a"], params)
    assert got["c"] == expected_output(prompts["c"], params)
    assert sched.cache.get_num_free_blocks() == 64 and not sched.suspects


def test_abort_with_error_reason() -> None:
    sched, _ = make(budget=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    r = Request("x", [1] * 6, params)
    w = Request("w", [2] * 20, params)
    z = Request("z", [3] * 4, params)
    for req in (r, w, z):
        sched.add_request(req)
    for _ in range(3):
        sched.schedule()
    assert r.num_output_tokens == 3 and w.num_output_tokens == 0 and w.num_computed_tokens == 16
    assert [q.request_id for q in sched.waiting] == ["z"]  # no budget left for it
    sched.isolate(["x", "w", "z"])
    out = sched.abort("x", "error")
    assert out is not None
    assert (out.request_id, out.new_token_ids, out.finished, out.finish_reason, out.num_output_tokens) == (
        "x", [], True, "error", 3)
    assert r.finish_reason == "error" and "x" not in sched.requests and sched.cache.get_block_table("x") == []
    out = sched.abort("w", "error")  # one still in its prefill too
    assert out is not None and out.finish_reason == "error" and w.finish_reason == "error"
    out = sched.abort("z", "error")  # and a waiting one
    assert out is not None and out.finish_reason == "error" and out.num_output_tokens == 0 and not sched.waiting
    assert sched.decide() == {} and sched.suspects == []  # aborted suspects are dropped
    assert sched.cache.get_num_free_blocks() == 64
    sched.cache.check_invariants()
