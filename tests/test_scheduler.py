"""Scheduler logic with a scripted executor whose next token depends only on the last token and
its position, so the expected outputs are known exactly however the steps are chunked.
(The real model is exercised by tests/test_engine.py.)

The scheduler decides steps (`Scheduler.schedule` -> `SchedulerOutput`), an `EngineCore` sends
them to the executor and applies their tokens. With ``async_scheduling=False`` each step is
scheduled after the previous one's tokens are applied, so one `EngineCore.step` is one whole step
(tests of exact step plans use it); with async scheduling step N+1 is scheduled before step N's
tokens arrive, and every output must be the same.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from common.config import ExecutorInfo, SchedulerConfig
from common.protocol import ExecutorOutput
from common.sampling_params import SamplingParams
from executor.input_batch import Batch
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.fake_executor import FakeExecutor

pytestmark = pytest.mark.unit

VOCAB = 97
EOS = 0

# Tests about outputs run both ways: the outputs must not depend on scheduling one step ahead.
BOTH = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def next_token(last: int, position: int) -> int:
    return (last * 7 + position + 1) % VOCAB


class ScriptedExecutor(FakeExecutor):
    """Keeps the executor's request state (`PersistentBatch`) like `ModelExecutor` does, and
    samples ``next_token(last, position)``; records every step and batch it ran."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_model_len: int = 64) -> None:
        super().__init__(ExecutorInfo("scripted", num_blocks, block_size, max_model_len, [EOS], VOCAB))
        self.sampled: dict[str, int] = {}  # tokens sampled per request, any never reported included

    def run_batch(self, batch: Batch) -> list[int]:
        batch.check()
        assert max(batch.seq_lens) <= self.info.max_model_len
        token_ids = []
        start = 0
        for i, q in enumerate(batch.query_lens):
            start += q
            last, pos = batch.input_ids[start - 1], batch.positions[start - 1]
            assert pos == batch.seq_lens[i] - 1
            if batch.sample[i]:
                token_ids.append(next_token(last, pos))
                self.sampled[batch.request_ids[i]] = self.sampled.get(batch.request_ids[i], 0) + 1
            else:
                token_ids.append(-1)
        return token_ids


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


def engine(
    ex: ScriptedExecutor, budget: int = 16, max_seqs: int = 8, async_scheduling: bool = False
) -> tuple[Scheduler, EngineCore]:
    sched = Scheduler(SchedulerConfig(budget, max_seqs), CacheManager(ex.info.num_blocks, ex.info.block_size), ex.info)
    return sched, EngineCore(sched, InlineExecutor(ex), async_scheduling=async_scheduling)


def make(
    num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, max_model_len: int = 64, async_scheduling: bool = False
) -> tuple[Scheduler, ScriptedExecutor, EngineCore]:
    ex = ScriptedExecutor(num_blocks, max_model_len=max_model_len)
    sched, core = engine(ex, budget, max_seqs, async_scheduling)
    return sched, ex, core


def step(core: EngineCore, got: dict[str, list[int]], finished: dict[str, str | None] | None = None) -> None:
    """One `EngineCore.step`, appending each request's new tokens to ``got``; checks that a finished
    request reports nothing more, that counts add up, and the pool invariants."""
    finished = {} if finished is None else finished
    for o in core.step():
        assert o.request_id not in finished, f"{o.request_id} reported a token after it finished"
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert o.num_output_tokens == len(got[o.request_id])
        if o.finished:
            finished[o.request_id] = o.finish_reason
    assert len(core.in_flight) <= core.depth
    core.scheduler.cache.check_invariants()


def run(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    sched = core.scheduler
    for r in requests:
        sched.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: dict[str, str | None] = {}
    while core.has_work():
        step(core, got, finished)
    assert finished == {r.request_id: r.finish_reason for r in requests}
    assert all(got[r.request_id] == r.output_token_ids for r in requests)
    sched.cache.check_invariants()
    return got


def plans(ex: ScriptedExecutor, start: int = 0) -> list[dict[str, int]]:
    return [dict(zip(bt.request_ids, bt.query_lens)) for bt in ex.batches[start:]]


@BOTH
def test_chunked_prefill_mixes_with_decodes(async_scheduling: bool) -> None:
    sched, ex, core = make(budget=10, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = Request("a", list(range(1, 4)), params)
    b = Request("b", list(range(1, 26)), params)
    got = run(core, [a, b])
    p = plans(ex)
    # The same plans either way: a decode is scheduled on a's placeholder token.
    assert p[0] == {"a": 3, "b": 7}
    assert p[1] == {"a": 1, "b": 9}  # a decode next to a prefill chunk
    assert p[2] == {"a": 1, "b": 9}
    assert ex.batches[2].sample.tolist() == [True, True]
    assert ex.batches[1].sample.tolist() == [True, False]
    assert got["a"] == expected_output(a.prompt_token_ids, params)
    assert got["b"] == expected_output(b.prompt_token_ids, params)
    assert all(sum(q.values()) <= 10 for q in p)
    assert ex.sampled == {"a": 5, "b": 5}  # max_tokens is known ahead: no step is wasted


@BOTH
def test_max_num_seqs_and_fcfs(async_scheduling: bool) -> None:
    sched, ex, core = make(budget=100, max_seqs=2, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reqs = [Request(str(i), [i + 1, 2, 3], params) for i in range(5)]
    got = run(core, reqs)
    for bt in ex.batches:
        assert len(bt.request_ids) <= 2
    first_seen: list[str] = []
    for bt in ex.batches:
        first_seen += [r for r in bt.request_ids if r not in first_seen]
    assert first_seen == ["0", "1", "2", "3", "4"]
    assert got == {r.request_id: expected_output(r.prompt_token_ids, params) for r in reqs}


@BOTH
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
def test_stop_conditions(params: SamplingParams, async_scheduling: bool) -> None:
    sched, _, core = make(async_scheduling=async_scheduling)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5], [3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]
    got = run(core, [Request(str(i), p, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[str(i)] == expected_output(p, params)


@BOTH
def test_max_model_len_stops_with_length(async_scheduling: bool) -> None:
    sched, ex, core = make(max_model_len=20, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    r = Request("x", list(range(1, 16)), params)
    got = run(core, [r])
    assert len(got["x"]) == 5 and r.finish_reason == "length"
    assert got["x"] == expected_output(r.prompt_token_ids, params, max_model_len=20)
    # The executor never ran past max_model_len (it asserts so) and sampled no extra token.
    assert max(max(bt.seq_lens) for bt in ex.batches) == 19 and ex.sampled == {"x": 5}


@pytest.mark.parametrize("stop", ["eos", "stop_token"])
def test_async_stop_one_step_late_is_never_reported(stop: str) -> None:
    """A stop token is only known when its step's output arrives, after the next step has been
    scheduled: that step runs (one wasted token), but its token is dropped, never reported, and
    the request ends exactly as it would without async scheduling."""
    if stop == "eos":
        params = SamplingParams(temperature=0, max_tokens=40)
        prompt = [3, 1, 4]  # -> 31, 27, EOS
    else:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[61])
        prompt = [11]  # -> 78, 63, 56, 8, 61
    want = expected_output(prompt, params)
    assert len(want) in (3, 5) and want[-1] in (EOS, 61)
    for async_scheduling in (False, True):
        sched, ex, core = make(async_scheduling=async_scheduling)
        r = Request("r", list(prompt), params)
        got = run(core, [r])
        assert got["r"] == r.output_token_ids == want and r.finish_reason == "stop"
        # Only with async did the executor run (and sample) one more step for it.
        assert ex.sampled["r"] == len(want) + async_scheduling
        assert len(ex.batches) == len(want) + async_scheduling
        assert sched.num_steps == len(ex.batches) and not sched.pending and not core.in_flight


def test_async_never_exceeds_max_tokens_or_max_model_len() -> None:
    """The scheduler knows when a request's last token is on its way and schedules it no further."""
    sched, ex, core = make(max_model_len=24, async_scheduling=True)
    reqs = [
        Request("tokens", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        Request("one", [4, 5], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        Request("len", list(range(1, 18)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)),
    ]
    seen = 0
    for r in reqs:
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    while core.has_work():
        step(core, got)
        for r in reqs:  # output + tokens on their way never pass a limit
            assert r.num_output_tokens + r.num_output_placeholders <= r.sampling_params.max_tokens
            assert r.num_tokens + r.num_output_placeholders <= 24
        seen = max(seen, len(core.in_flight))
    assert seen == 1  # one step ahead: between two calls, one step is on its way
    assert ex.sampled == {"tokens": 6, "one": 1, "len": 7}
    assert {r.request_id: len(got[r.request_id]) for r in reqs} == ex.sampled
    assert all(r.finish_reason == "length" for r in reqs)
    assert max(max(bt.seq_lens) for bt in ex.batches) == 23


def test_async_schedules_the_next_step_before_the_tokens_arrive() -> None:
    sched, ex, core = make(async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    r = Request("r", [1, 2, 3], params)
    sched.add_request(r)
    assert core.step() == []  # step 1 sent; nothing applied yet
    assert len(core.in_flight) == 1 and r.num_computed_tokens == 3 and r.num_output_placeholders == 1
    outs = core.step()  # step 2 is scheduled on step 1's placeholder, then step 1 is applied
    assert len(ex.outputs) == 2 and len(core.in_flight) == 1
    second = ex.outputs[1]
    assert second.new_req_ids == [] and second.scheduled_req_ids == ["r"]
    assert (second.num_scheduled_tokens, second.num_computed_tokens) == ([1], [3])
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("r", [next_token(3, 2)])]
    assert r.num_output_tokens == 1 and r.num_output_placeholders == 1 and r.num_computed_tokens == 4
    # Without async scheduling each step applies its own tokens before the next is decided.
    sched, ex, core = make(async_scheduling=False)
    sched.add_request(Request("r", [1, 2, 3], params))
    assert [o.new_token_ids for o in core.step()] == [[next_token(3, 2)]] and not core.in_flight


@BOTH
def test_finished_ids_reach_the_executor(async_scheduling: bool) -> None:
    """The executor drops a request's state when a later step names it in ``finished_req_ids``;
    what finished after the last step waits in ``finished_for_executor`` for the next one."""
    sched, ex, core = make(budget=32, async_scheduling=async_scheduling)
    eos = SamplingParams(temperature=0, max_tokens=40)
    length = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reqs = [
        Request("eos", [3, 1, 4], eos),
        Request("len", [1, 2], length),
        Request("long", [11], eos),
        Request("gone", [5, 5, 5], length),
    ]
    for r in reqs:
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    step(core, got)
    step(core, got)
    assert sched.abort("gone") is not None
    while core.has_work():
        step(core, got)
    assert got["eos"] == expected_output([3, 1, 4], eos) and got["long"] == expected_output([11], eos)
    assert got["len"] == expected_output([1, 2], length)
    sent = [rid for out in ex.outputs for rid in out.finished_req_ids]
    assert sorted(sent + sched.finished_for_executor) == ["eos", "gone", "len", "long"]  # each once
    assert sched.executor_blocks == {}
    assert set(ex.state.requests) == set(sched.finished_for_executor) == {"long"}  # the last to finish
    # One more request: its first step carries the rest, and the executor ends up holding nothing else.
    late = Request("late", [2], length)
    got |= run(core, [late])
    first = next(out for out in ex.outputs if out.new_req_ids == ["late"])
    assert first.finished_req_ids == ["long"]
    assert set(ex.state.requests) == set(sched.finished_for_executor) == {"late"}


@BOTH
def test_preemption_recomputes_to_identical_outputs(async_scheduling: bool) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[i + 1] * (5 + 3 * i) for i in range(8)]
    big, _, big_core = make(num_blocks=200, budget=32, async_scheduling=async_scheduling)
    # 64 tokens: room for ~2 sequences of 34+ tokens
    small, _, small_core = make(num_blocks=16, budget=32, async_scheduling=async_scheduling)
    want = run(big_core, [Request(str(i), p, params) for i, p in enumerate(prompts)])
    got = run(small_core, [Request(str(i), p, params) for i, p in enumerate(prompts)])
    assert big.num_preemptions == 0
    assert small.num_preemptions > 0
    assert got == want == {str(i): expected_output(p, params) for i, p in enumerate(prompts)}
    assert small.cache.get_num_free_blocks() == 16


@pytest.mark.parametrize("steps_in_flight", [3, 4])
def test_more_steps_in_flight_give_the_same_outputs(steps_in_flight: int) -> None:
    """With several steps sent ahead: the same tokens as one at a time (through preemptions, whose
    requests wait for the tokens still in flight before they are admitted again), a request that
    stops costs ``steps_in_flight - 1`` dropped steps, and never more than that many are in flight."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [[i + 1] * (5 + 3 * i) for i in range(8)]
    for num_blocks, preempts in ((200, False), (16, True)):
        ex = ScriptedExecutor(num_blocks)
        sched = Scheduler(SchedulerConfig(32, 8), CacheManager(num_blocks, ex.info.block_size), ex.info)
        core = EngineCore(sched, InlineExecutor(ex), steps_in_flight=steps_in_flight)
        assert core.depth == steps_in_flight
        got = run(core, [Request(str(i), p, params) for i, p in enumerate(prompts)])
        assert got == {str(i): expected_output(p, params) for i, p in enumerate(prompts)}
        assert (sched.num_preemptions > 0) == preempts and sched.cache.get_num_free_blocks() == num_blocks
    stop = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[61])
    want = expected_output([11], stop)
    ex = ScriptedExecutor(64)
    sched = Scheduler(SchedulerConfig(16, 8), CacheManager(64, ex.info.block_size), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), steps_in_flight=steps_in_flight)
    assert run(core, [Request("r", [11], stop)]) == {"r": want}
    assert ex.sampled["r"] == len(want) + steps_in_flight - 1


class KVCheckingExecutor(ScriptedExecutor):
    """`ScriptedExecutor` that also writes a record of each position's token prefix into its KV
    slot, as a forward pass writes K/V, then checks that every position a row attends to holds
    that row's own prefix: a block shared or reused wrongly shows as stale K/V."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_model_len: int = 64) -> None:
        super().__init__(num_blocks, block_size, max_model_len)
        self.kv: dict[int, tuple[int, ...]] = {}

    def run_batch(self, batch: Batch) -> list[int]:
        bs = self.info.block_size
        rows = [
            (rid, self.state.requests[rid].token_ids, batch.seq_lens[i], batch.query_lens[i], batch.block_tables[i])
            for i, rid in enumerate(batch.request_ids)
        ]
        for _, tokens, end, q, table in rows:
            for p in range(end - q, end):
                self.kv[table[p // bs] * bs + p % bs] = tuple(tokens[: p + 1])
        for rid, tokens, end, _, table in rows:
            for p in range(end):
                assert self.kv.get(table[p // bs] * bs + p % bs) == tuple(tokens[: p + 1]), (
                    f"{rid} attends to stale K/V at position {p} (table {table})"
                )
        return super().run_batch(batch)


def test_a_preempted_request_waits_for_its_prefill_chunks_in_flight() -> None:
    """Three steps in flight: R is preempted while a prefill chunk of its old table is in flight
    (it samples nothing, so it leaves no placeholder). Readmitted before that chunk's output came
    back, R had the chunk's blocks registered in the prefix cache against its new table, whose
    K/V there was never written, and read it after its next preemption."""
    ex = KVCheckingExecutor(4, 4, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=5, max_num_seqs=8), CacheManager(4, 4), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=True, steps_in_flight=3)
    b = Request("B", [30], SamplingParams(max_tokens=4, ignore_eos=True))
    r = Request("R", list(range(10, 23)), SamplingParams(max_tokens=1, ignore_eos=True))
    assert run(core, [b, r]) == {
        "B": expected_output(b.prompt_token_ids, b.sampling_params),
        "R": expected_output(r.prompt_token_ids, r.sampling_params),
    }
    assert sched.num_preemptions > 0


def test_random_workloads_keep_their_kv_and_outputs() -> None:
    """Random mixes of shared prefixes (salted or not), lengths, aborts, steps in flight and small
    pools (preemptions): every row reads only K/V of its own prefix, every request that is not
    aborted gets exactly the tokens of running alone (aborted ones a prefix of them), and the pool
    ends empty. 500 seeds take about a second; before the fix for readmission with a step in flight,
    seeds 88 and 365 read stale K/V (10 of the first 2,000)."""
    for seed in range(500):
        try:
            random_workload(seed)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc


def random_workload(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    num_blocks = -(-30 // block_size) + rng.randint(0, 4)  # the longest request takes 28 tokens
    depth = rng.choice([1, 2, 3, 4])
    config = SchedulerConfig(rng.choice([3, 5, 8, 16]), rng.choice([2, 4, 8]), enable_prefix_caching=rng.random() < 0.8)
    ex = KVCheckingExecutor(num_blocks, block_size)
    sched = Scheduler(config, CacheManager(num_blocks, block_size), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=depth > 1, steps_in_flight=max(depth, 2))
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(4, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
        requests.append(Request(str(i), prompt, params, cache_salt=rng.choice([None, None, "s1"])))
    pending = list(requests)
    aborted: set[str] = set()
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    while pending or core.has_work():
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        live = [r.request_id for r in requests if r.request_id in sched.requests]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            aborted.add(victim)
            out = sched.abort(victim)
            assert out is not None
            finished[victim] = "abort"
        if core.has_work():
            step(core, got, finished)
    for r in requests:
        want = expected_output(r.prompt_token_ids, r.sampling_params)
        mine = got.get(r.request_id, [])
        assert (mine == want[: len(mine)]) if r.request_id in aborted else (mine == want), r.request_id
    sched.cache.check_invariants()
    assert sched.cache.get_num_free_blocks() == num_blocks and not sched.requests and not sched.pending


def test_prompt_logprobs_survive_a_preemption_mid_prompt() -> None:
    """A request preempted part-way through its prompt recomputes it in other chunks; the prompt
    logprobs it has are kept, and later chunks add what is new even when a chunk does not begin
    exactly where they end, so it finishes with every one."""

    class PromptLogprobsExecutor(FakeExecutor):
        def execute_model(self, output):  # type: ignore[no-untyped-def]
            batch = self.state.prepare(output)
            sampled = [1 if s else -1 for s in batch.sample]
            per_row: list[Any] = [None] * batch.num_seqs
            for i, count, _ in batch.prompt_lp:
                start = batch.seq_lens[i] - batch.query_lens[i]
                tokens = self.state.requests[batch.request_ids[i]].token_ids
                per_row[i] = [{tokens[p + 1]: -float(p)} for p in range(start, start + count)]
            self.state.append_sampled(batch, sampled)
            return ExecutorOutput(sampled, [None] * len(sampled), per_row if batch.prompt_lp else [])

    info = ExecutorInfo("x", 8, 2, 16, [0], 50)
    config = SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=8, enable_prefix_caching=False)
    sched = Scheduler(config, CacheManager(8, 2), info)
    core = EngineCore(sched, InlineExecutor(PromptLogprobsExecutor(info)), async_scheduling=False)
    a = Request("A", list(range(10, 22)), SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1))
    sched.add_request(Request("B", [2, 3], SamplingParams(max_tokens=8, ignore_eos=True)))
    sched.add_request(a)
    sent = None
    while core.has_work():
        sent = next((o.prompt_logprobs for o in core.step() if o.request_id == "A" and o.prompt_logprobs), sent)
    assert a.num_preemptions == 1 and sent is not None
    # One entry per prompt token (None first), each the logprob of that token at its own position.
    assert sent == [None, *[{a.prompt_token_ids[p + 1]: -float(p)} for p in range(len(a.prompt_token_ids) - 1)]]


def test_preempted_request_goes_to_head_of_waiting() -> None:
    sched, _, core = make(num_blocks=4, budget=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a, b, c = (Request(n, [1] * 7, params) for n in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    core.step()  # a and b take 2 blocks each; c waits
    core.step()  # the 8th token still fits in 2 blocks
    assert [r.request_id for r in sched.running] == ["a", "b"]
    core.step()  # both need a 3rd block: b (admitted last) is preempted
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.num_computed_tokens == 0 and sched.num_preemptions == 1
    assert sched.executor_blocks["b"] == -1  # the executor keeps b's tokens; its table is resent


@BOTH
def test_abort_frees_blocks_at_once(async_scheduling: bool) -> None:
    sched, ex, core = make(budget=8, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        sched.add_request(Request(str(i), [1] * 20, params))
    core.step()
    core.step()
    assert sched.cache.get_num_free_blocks() < 64
    for i in range(3):
        out = sched.abort(str(i))
        assert out is not None and out.finish_reason == "abort"
    assert sched.abort("nope") is None
    assert not sched.has_unfinished()
    assert sched.cache.get_num_free_blocks() == 64
    sched.cache.check_invariants()
    assert core.has_work() == async_scheduling  # a step still in flight
    while core.has_work():
        assert core.step() == []  # its tokens are dropped
    assert sched.cache.get_num_free_blocks() == 64
    # The executor holds the one it has seen (a budget of 8: "0"'s prompt) until a next step
    # tells it that it is finished.
    assert sched.finished_for_executor == ["0"] and set(ex.state.requests) == {"0"}
    run(core, [Request("x", [1], SamplingParams(temperature=0, max_tokens=1))])
    assert ex.outputs[-1].finished_req_ids == ["0"] and set(ex.state.requests) == {"x"}


def test_rejects_bad_requests() -> None:
    sched, _, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("long", [1] * 17, SamplingParams()))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(Request("empty", [], SamplingParams()))
    sched.add_request(Request("ok", [1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(Request("ok", [1], SamplingParams()))


# -- faults: a new executor, and isolating the request that fails a step ---------------------------
step_plans = plans


def collect(core: EngineCore, got: dict[str, list[int]], steps: int | None = None) -> None:
    """Run ``steps`` engine steps (None: to the end), appending each request's new tokens to ``got``."""
    n = 0
    while core.has_work() and (steps is None or n < steps):
        step(core, got)
        n += 1


@BOTH
def test_reset_executor_moves_everything_and_continues_identically(async_scheduling: bool) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6], "c": [5, 3, 5, 8, 9, 7, 9], "d": [2, 7]}
    sched, old_ex, core = make(num_blocks=64, budget=32, max_seqs=3, async_scheduling=async_scheduling)
    old_cache = sched.cache
    reqs = {rid: Request(rid, p, params) for rid, p in prompts.items()}
    for r in reqs.values():
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    collect(core, got, steps=3)
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert running == ["a", "b", "c"] and waiting == ["d"]
    assert all(reqs[r].num_computed_tokens > 0 for r in running)
    assert old_cache.get_num_free_blocks() < 64
    assert len(core.in_flight) == async_scheduling  # with async, a step the old executor never answers
    preemptions = sched.num_preemptions

    new_ex = ScriptedExecutor(32, max_model_len=48)
    new_cache = CacheManager(32, 4)
    sched.reset_executor(new_ex.info, new_cache)
    core = EngineCore(sched, InlineExecutor(new_ex), async_scheduling=async_scheduling)  # as the service does

    # Everything waits, running requests first and in their order, with nothing computed.
    assert sched.running == [] and [r.request_id for r in sched.waiting] == running + waiting
    assert all(r.num_computed_tokens == 0 and r.num_output_placeholders == 0 for r in reqs.values())
    assert all(reqs[r].num_preemptions == 1 for r in running) and reqs["d"].num_preemptions == 0
    assert sched.num_preemptions == preemptions  # vLLM's count is of memory pressure, not of a lost executor
    assert sched.executor_blocks == {} and not sched.pending  # the new executor gets everything as new
    # The old pool got every block back; the new one is untouched until the next step.
    assert old_cache.get_num_free_blocks() == 64 and old_cache.block_tables == {}
    old_cache.check_invariants()
    assert sched.cache is new_cache and sched.info is new_ex.info and new_cache.get_num_free_blocks() == 32
    assert sched.max_model_len == 48
    # Tokens generated so far are kept: the first new step recomputes prompt + output from 0.
    kept = {r: list(reqs[r].output_token_ids) for r in prompts}
    assert kept == {r: got.get(r, []) for r in prompts}
    n_old_batches = len(old_ex.batches)
    collect(core, got)
    assert len(old_ex.batches) == n_old_batches  # the old executor is never called again
    first, first_out = new_ex.batches[0], new_ex.outputs[0]
    assert first_out.new_req_ids == running
    for rid in running:
        i = first.request_ids.index(rid)
        assert first.positions[sum(first.query_lens[:i])] == 0
        assert first.input_ids[sum(first.query_lens[:i])] == prompts[rid][0]
    # And generation goes on exactly as without the fault.
    for rid, prompt in prompts.items():
        assert got[rid] == expected_output(prompt, params)
        assert reqs[rid].finish_reason == "length"
    assert new_cache.get_num_free_blocks() == 32 and old_cache.get_num_free_blocks() == 64


def test_reset_executor_to_a_shorter_context_fails_what_no_longer_fits_and_serves_the_rest() -> None:
    """A standby executor with a smaller ``max_model_len`` takes over: a request it cannot hold is
    failed at once (kept, it would preempt itself step after step), the others finish as before."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sched, _, core = make(num_blocks=64, budget=32, max_model_len=64)
    long, short = Request("long", list(range(1, 31)), params), Request("short", [9, 2, 6], params)  # 42 and 15 tokens
    for r in (long, short):
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    collect(core, got, steps=2)
    new_ex = ScriptedExecutor(8, max_model_len=32)  # 8 blocks of 4: 32 tokens
    unfit = sched.reset_executor(new_ex.info, CacheManager(8, 4))
    assert list(unfit) == ["long"] and "exceeds max_model_len (32)" in unfit["long"]
    assert long.finish_reason == "error" and "long" not in sched.requests
    collect(EngineCore(sched, InlineExecutor(new_ex)), got)
    assert short.finish_reason == "length" and short.output_token_ids == expected_output([9, 2, 6], params)
    sched.cache.check_invariants()
    del core


def test_preempt_all_keeps_order_ahead_of_waiting() -> None:
    sched, _, core = make(budget=64, max_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for rid in "xyz":
        sched.add_request(Request(rid, [1, 2, 3], params))
    core.step()
    assert [r.request_id for r in sched.running] == ["x", "y"]
    sched.preempt_all()
    assert sched.running == [] and [r.request_id for r in sched.waiting] == ["x", "y", "z"]
    assert sched.cache.get_num_free_blocks() == 64
    sched.cache.check_invariants()


def test_isolate_runs_one_suspect_per_step_until_each_passed() -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9], "d": [3, 3, 3]}
    sched, ex, core = make(budget=64)
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, params))
    got: dict[str, list[int]] = {}
    collect(core, got, steps=2)
    # A step with a, b, c, d failed: the executor dropped its state, so everything is recomputed.
    ex.state.clear()
    core.reset()
    assert sched.running == [] and sched.executor_blocks == {}
    sched.isolate(["c", "ghost", "a", "b"])  # unknown ids are ignored; d is not a suspect
    assert sched.suspects == ["c", "a", "b"]
    mark = len(ex.batches)
    collect(core, got, steps=3)
    # One suspect per step, in the order given, each recomputed but for what the prefix cache
    # holds: whole blocks (of 4) that earlier, successful steps filled, never the last token.
    redo = {rid: len(p) + 2 - 4 * ((len(p) + 1) // 4) for rid, p in prompts.items()}
    assert redo == {"a": 1, "b": 2, "c": 4, "d": 1}
    assert step_plans(ex, mark) == [{"c": redo["c"]}, {"a": redo["a"]}, {"b": redo["b"]}]
    assert [out.new_req_ids for out in ex.outputs[mark:]] == [["c"], ["a"], ["b"]]  # resent whole
    assert sched.suspects == []
    # Then normal batching again: everyone in one step.
    collect(core, got, steps=1)
    assert set(step_plans(ex, mark + 3)[0]) == {"a", "b", "c", "d"}
    collect(core, got)
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, params)


def test_isolate_a_running_request_leaves_the_others_their_blocks() -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sched, ex, core = make(budget=64)
    for rid in "ab":
        sched.add_request(Request(rid, [1, 2, 3, 4, 5], params))
    got: dict[str, list[int]] = {}
    collect(core, got, steps=2)
    table_a = list(sched.cache.get_block_table("a"))
    sched.isolate(["b"])
    collect(core, got, steps=1)
    assert step_plans(ex)[-1] == {"b": 1}  # a decode, alone
    assert sched.cache.get_block_table("a") == table_a and sched.requests["a"].num_computed_tokens == 6
    collect(core, got, steps=1)
    assert step_plans(ex)[-1] == {"a": 1, "b": 1}
    collect(core, got)
    assert got["a"] == got["b"] == expected_output([1, 2, 3, 4, 5], params)


class FailingExecutor(ScriptedExecutor):
    """Fails every step that includes the request ``bad`` (dropping its state, as a real one does)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.failed: list[dict[str, int]] = []  # the plans of the steps that failed

    def run_batch(self, batch: Batch) -> list[int]:
        if "bad" in batch.request_ids:
            self.failed.append(dict(zip(batch.request_ids, batch.query_lens)))
            raise RuntimeError("illegal memory access")
        return super().run_batch(batch)


@BOTH
def test_isolation_finds_the_culprit_which_fails_with_error(async_scheduling: bool) -> None:
    """What the scheduler service does on a failed step (`_step_failed`), with a request that
    always breaks it."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = {"a": [1, 2, 3], "bad": [4, 5], "c": [6, 7, 8, 9]}
    ex = FailingExecutor(64)
    sched, core = engine(ex, 64, 8, async_scheduling)
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, params))
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    failures = 0
    while core.has_work():
        try:
            step(core, got, finished)
        except RuntimeError:
            failures += 1
            # The core voided every step in flight and the scheduler resends everything as new.
            assert not core.in_flight and not sched.pending and sched.executor_blocks == {}
            assert sched.running == [] and ex.state.requests == {}
            assert core.failed_request_ids == list(ex.failed[-1])
            culprit = sched.step_failed(core.failed_request_ids)
            if culprit is not None:
                assert culprit not in sched.requests
                finished[culprit] = "error"
            sched.cache.check_invariants()
    assert failures == 2  # the batch, then "bad" alone
    assert ex.failed == [{"a": 3, "bad": 2, "c": 4}, {"bad": 2}]
    if not async_scheduling:
        assert step_plans(ex)[:3] == [{"a": 3, "bad": 2, "c": 4}, {"a": 3}, {"bad": 2}]
    assert finished == {"a": "length", "bad": "error", "c": "length"}
    assert "bad" not in got and got["a"] == expected_output(prompts["a"], params)
    assert got["c"] == expected_output(prompts["c"], params)
    assert sched.cache.get_num_free_blocks() == 64 and not sched.suspects


def test_a_culprit_aborted_while_its_step_ran_leaves_no_one_to_blame() -> None:
    ex = FailingExecutor(64)
    sched, core = engine(ex, 64, 8, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sched.add_request(Request("a", [1, 2, 3], params))
    sched.add_request(Request("bad", [4, 5], params))
    core.step()  # the step {a, bad} is in flight (it fails)
    sched.abort("bad")  # the client gives up meanwhile
    with pytest.raises(RuntimeError):
        core.step()
    assert core.failed_request_ids == ["a", "bad"]
    assert sched.step_failed(core.failed_request_ids) is None  # "a" is isolated, not failed
    assert sched.suspects == ["a"] and "a" in sched.requests
    got: dict[str, list[int]] = {}
    while core.has_work():
        step(core, got, {})
    assert got["a"] == expected_output([1, 2, 3], params)


def test_steps_after_a_failed_one_are_not_run_in_process() -> None:
    """A step queued behind one that failed is void: running it would leave state in the executor
    that the scheduler (which resends everything) no longer tracks."""
    ex = FailingExecutor(64)
    sched, core = engine(ex, 64, 8, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sched.add_request(Request("bad", [4, 5], SamplingParams(temperature=0, max_tokens=1)))
    core.step()
    sched.add_request(Request("x", [1, 2, 3], params))
    with pytest.raises(RuntimeError):
        core.step()  # step 2 ({x}: bad's only token is on the way) was queued behind the failed step 1
    assert ex.state.requests == {} and sched.executor_blocks == {}
    assert sched.step_failed(core.failed_request_ids) == "bad"
    got: dict[str, list[int]] = {}
    while core.has_work():
        step(core, got, {})
    assert got == {"x": expected_output([1, 2, 3], params)} and ex.state.requests.keys() <= {"x"}


def test_abort_with_error_reason() -> None:
    sched, _, core = make(budget=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    r = Request("x", [1] * 6, params)
    w = Request("w", [2] * 20, params)
    z = Request("z", [3] * 4, params)
    for req in (r, w, z):
        sched.add_request(req)
    for _ in range(3):
        core.step()
    assert r.num_output_tokens == 3 and w.num_output_tokens == 0 and w.num_computed_tokens == 16
    assert [q.request_id for q in sched.waiting] == ["z"]  # no budget left for it
    sched.isolate(["x", "w", "z"])
    out = sched.abort("x", "error")
    assert out is not None
    assert (out.request_id, out.new_token_ids, out.finished, out.finish_reason, out.num_output_tokens) == (
        "x",
        [],
        True,
        "error",
        3,
    )
    assert r.finish_reason == "error" and "x" not in sched.requests and sched.cache.get_block_table("x") == []
    out = sched.abort("w", "error")  # one still in its prefill too
    assert out is not None and out.finish_reason == "error" and w.finish_reason == "error"
    out = sched.abort("z", "error")  # and a waiting one
    assert out is not None and out.finish_reason == "error" and out.num_output_tokens == 0 and not sched.waiting
    assert sched.decide() == {} and sched.suspects == []  # aborted suspects are dropped
    assert sched.cache.get_num_free_blocks() == 64
    sched.cache.check_invariants()


def test_a_result_without_the_token_a_row_was_due_is_refused() -> None:
    """An executor's -1 ("not sampled") for a row the step samples is an error, not a token."""
    sched, ex, _ = make()
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="request a was due a token in step"):
        sched.update_from_output(out, ExecutorOutput([-1], []))
