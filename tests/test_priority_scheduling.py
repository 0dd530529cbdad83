"""The priority scheduling policy (vLLM's): admission by ``(priority, arrival)``, preemption of the
lowest priority first, and the same outputs as without it. The scripted executor of
tests/test_scheduler.py makes every expected output known exactly."""

from __future__ import annotations

import random
from typing import Any

import pytest

from common.config import SchedulerConfig
from common.sampling_params import SamplingParams
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.request import Request
from scheduler.request_queue import WaitingQueue, pick_victim
from scheduler.scheduler import Scheduler
from scheduler.step_bytes import prompt_logprob_bytes
from tests.test_scheduler import ScriptedExecutor, expected_output, run, step

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prioritized(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8) -> tuple[Scheduler, EngineCore]:
    ex = ScriptedExecutor(num_blocks)
    config = SchedulerConfig(budget, max_seqs, async_scheduling=False, scheduling_policy="priority")
    sched = Scheduler(config, CacheManager(num_blocks, ex.info.block_size), ex.info)
    return sched, EngineCore(sched, InlineExecutor(ex), async_scheduling=False)


def request(name: str, priority: int, arrival: float, prompt_len: int = 7) -> Request:
    return Request(name, [1 + len(name)] * prompt_len, GREEDY, arrival_time=arrival, priority=priority)


def byte_bound(max_seqs: int, positions: int, params: SamplingParams) -> Scheduler:
    """A priority scheduler (16 blocks of 4, no prefix caching) whose steps hold the prompt
    logprobs of ``positions`` positions under ``params``."""
    ex = ScriptedExecutor(16)
    per = prompt_logprob_bytes(Request("t", [1], params))
    config = SchedulerConfig(
        128,
        max_seqs,
        enable_prefix_caching=False,
        async_scheduling=False,
        max_step_bytes=positions * per,
        scheduling_policy="priority",
    )
    return Scheduler(config, CacheManager(16, 4), ex.info)


def _running(sched: Scheduler, name: str, prompt: list[int], params: SamplingParams, priority: int, computed: int) -> Request:
    """A request placed straight into the running ones, ``computed`` of its tokens allocated."""
    r = Request(name, prompt, params, arrival_time=float(len(sched.requests)), priority=priority)
    sched.add_request(r)
    sched.waiting.remove(r)
    if computed:
        assert sched.cache.allocate_slots(name, computed)
    r.num_computed_tokens = computed
    sched._start_running(r)
    return r


def test_waiting_queue_orders_by_priority_then_arrival() -> None:
    queue = WaitingQueue("priority")
    for name, priority, arrival in [("a", 3, 1.0), ("b", 1, 2.0), ("c", 2, 3.0), ("d", 1, 4.0), ("e", 2, 5.0)]:
        queue.add(request(name, priority, arrival))
    assert [r.request_id for r in queue] == ["b", "d", "c", "e", "a"]
    early = request("p", 2, 0.5)  # preempted: it arrived before its peers
    queue.requeue(early)
    assert [r.request_id for r in queue] == ["b", "d", "p", "c", "e", "a"]
    queue.remove(queue[2])
    del queue[0]
    assert [(r.request_id, r.priority, r.arrival_time) for r in queue] == [
        ("d", 1, 4.0),
        ("c", 2, 3.0),
        ("e", 2, 5.0),
        ("a", 3, 1.0),
    ]
    queue.add(request("q", 2, 3.0))  # an equal key: after the one already there
    assert [r.request_id for r in queue] == ["d", "c", "q", "e", "a"]
    fcfs = WaitingQueue("fcfs")
    for r in (request("a", 0, 1.0), request("b", 0, 2.0)):
        fcfs.add(r)
    fcfs.requeue(request("p", 0, 3.0))
    assert [r.request_id for r in fcfs] == ["p", "a", "b"]


def test_victims_are_the_lowest_priority_latest_arrival() -> None:
    running = [request("a", 1, 1.0), request("b", 5, 2.0), request("c", 5, 3.0), request("d", 0, 4.0)]
    assert pick_victim(running, by_priority=True).request_id == "c"
    assert pick_victim(running, by_priority=True, spare=running[2]).request_id == "b"
    assert pick_victim(running, by_priority=False).request_id == "d"


def test_lower_priority_values_are_admitted_first() -> None:
    sched, core = prioritized(max_seqs=2)
    for r in (request("low", 5, 1.0), request("mid", 1, 2.0), request("high", 0, 3.0)):
        sched.add_request(r)
    core.step()
    assert sorted(r.request_id for r in sched.running) == ["high", "mid"]


def test_the_lowest_priority_is_preempted_even_when_scheduled_first_in_the_step() -> None:
    """``low`` runs first in the running queue and is scheduled first in the step; ``high`` then
    needs a block: ``low`` is preempted and its scheduled tokens given back."""
    sched, core = prioritized(num_blocks=4)  # 16 tokens: either request alone, to its end
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    low = Request("low", [3] * 6, params, arrival_time=1.0, priority=9)
    high = Request("high", [4] * 8, params, arrival_time=2.0, priority=0)
    got: dict[str, list[int]] = {}
    sched.add_request(low)
    step(core, got)
    sched.add_request(high)
    step(core, got)  # low: 7 tokens, high: 8, in 2 blocks each
    assert [r.request_id for r in sched.running] == ["low", "high"] and sched.cache.get_num_free_blocks() == 0
    step(core, got)  # low's 8th token fits (scheduled first), high's 9th needs a block
    assert [r.request_id for r in sched.running] == ["high"] and low.num_preemptions == 1
    assert ex_steps(core)[-1] == {"high": 1}
    while core.has_work():
        step(core, got)
    assert got["high"] == expected_output(high.prompt_token_ids, params)
    assert got["low"] == expected_output(low.prompt_token_ids, params)


def ex_steps(core: EngineCore) -> list[dict[str, int]]:
    """What each step the executor ran scheduled, per request."""
    ex = core.executor.executor  # type: ignore[attr-defined]
    return [dict(zip(o.scheduled_req_ids, o.num_scheduled_tokens)) for o in ex.outputs]


@pytest.mark.parametrize("seed", range(4))
def test_outputs_under_memory_pressure_are_those_of_fcfs(seed: int) -> None:
    """Random priorities, arrivals in bursts and a small pool (many preemptions, some of requests
    already scheduled in the step): every output is exactly the unconstrained one."""
    rng = random.Random(seed)
    sched, core = prioritized(num_blocks=12, budget=24, max_seqs=6)
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(1, 90) for _ in range(rng.randrange(2, 20))],
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True),
            arrival_time=float(i),
            priority=rng.randrange(-2, 3),
        )
        for i in range(16)
    ]
    run(core, requests)
    for r in requests:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params)
    assert sched.num_preemptions > 0


def test_fcfs_refuses_a_priority() -> None:
    ex = ScriptedExecutor(16)
    sched = Scheduler(SchedulerConfig(), CacheManager(16, ex.info.block_size), ex.info)
    with pytest.raises(ValueError, match="priority 3 needs the priority scheduling policy"):
        sched.add_request(request("x", 3, 1.0))
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(scheduling_policy="lifo").validate()


@pytest.mark.model
def test_the_offline_engine_runs_prompts_by_priority(tiny_model) -> None:
    """``LLM(scheduling_policy="priority").generate(prompts, params, priority=[...])``: one sequence
    at a time, prompts start in priority order; outputs come back in prompt order, unchanged."""
    from gateway.llm import LLM

    options = dict(dtype="float32", max_num_seqs=1, num_threads=1)
    llm = LLM(tiny_model(), scheduling_policy="priority", **options)  # type: ignore[arg-type]
    started: list[str] = []
    launch = llm.executor.launch

    def recording(output: Any) -> Any:
        started.extend(new.request_id for new in output.new_requests())
        return launch(output)

    llm.executor.launch = recording  # type: ignore[method-assign]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = llm.generate(prompts, params, priority=[2, 0, 1])
    assert [started.index(o.request_id) for o in got] == [2, 0, 1]
    assert [o.token_ids for o in got] == [o.token_ids for o in LLM(tiny_model(), **options).generate(prompts, params)]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate(prompts, params, priority=[1])
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        LLM(tiny_model(), **options).generate(prompts, params, priority=[0, 1, 0])  # type: ignore[arg-type]


def test_a_victim_before_the_current_request_does_not_make_the_next_one_skipped() -> None:
    """``a`` (lowest priority) has its last token in flight and is passed over; ``b`` needs a block
    and ``a`` is preempted for it: ``c``, after ``b``, is still scheduled in this step."""
    ex = ScriptedExecutor(5)
    sched = Scheduler(
        SchedulerConfig(64, 8, enable_prefix_caching=False, scheduling_policy="priority"), CacheManager(5, 4), ex.info
    )
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sched.add_request(Request("a", [5] * 3, one, arrival_time=1.0, priority=9))
    sched.schedule()  # a's prompt, sampling its only token: it has nothing more to schedule
    for name, size, arrival in (("b", 8, 2.0), ("c", 7, 3.0)):
        sched.add_request(Request(name, [6] * size, GREEDY, arrival_time=arrival, priority=0))
    sched.schedule()  # b and c's prompts: the pool is full
    assert [r.request_id for r in sched.running] == ["a", "b", "c"] and sched.cache.get_num_free_blocks() == 0
    assert sched.decide() == {"b": 1, "c": 1}  # b's 9th token takes a's blocks; c's 8th fits its own
    assert [r.request_id for r in sched.running] == ["b", "c"]


def test_budget_given_back_by_a_victim_goes_to_the_requests_passed_over() -> None:
    """Two low-priority prompt-logprob requests fill the step's bytes, so ``p2``'s are passed over;
    ``x`` then needs blocks: both are preempted (their bytes given back), and ``x`` too. ``p2`` gets
    the bytes: the step is not empty (an empty step with live requests stopped the engine)."""
    logprobs = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=10)
    sched = byte_bound(8, 13, logprobs)
    for name, prompt, params, priority, computed in (
        ("p1a", [3] * 13, logprobs, 9, 1),
        ("p1b", [4] * 13, logprobs, 9, 1),
        ("p2", [5] * 13, logprobs, 0, 9),
        ("x", [6] * 60, GREEDY, 5, 4),
    ):
        _running(sched, name, prompt, params, priority, computed)
    assert sched.decide() == {"p2": 4}
    assert [r.request_id for r in sched.running] == ["p2"] and [r.request_id for r in sched.waiting] == ["x", "p1a", "p1b"]
    sched.cache.check_invariants()


def test_a_waiting_request_displaces_a_lower_priority_one_when_the_seats_are_taken() -> None:
    """``max_num_seqs`` running requests of priority 5: one of priority 0 takes the seat of the
    latest of them (vLLM waits for a seat to free: its issue 40004); one of priority 5 does not."""
    sched, core = prioritized(max_seqs=2)
    got: dict[str, list[int]] = {}
    low1, low2, high, peer = request("low1", 5, 1.0), request("low2", 5, 2.0), request("high", 0, 3.0), request("peer", 5, 0.5)
    for r in (low1, low2):
        sched.add_request(r)
    step(core, got)
    sched.add_request(peer)  # (arrived first, but only as urgent as those running: it waits)
    step(core, got)
    assert [r.request_id for r in sched.running] == ["low1", "low2"] and peer.num_preemptions == 0
    sched.add_request(high)
    step(core, got)
    assert [r.request_id for r in sched.running] == ["low1", "high"] and low2.num_preemptions == 1
    assert ex_steps(core)[-1].keys() == {"low1", "high"}  # (low2, scheduled before high came to it, gave its token back)
    assert [r.request_id for r in sched.waiting] == ["peer", "low2"]
    while core.has_work():
        step(core, got)
    for r in (low1, low2, high, peer):
        assert got[r.request_id] == expected_output(r.prompt_token_ids, GREEDY)


def test_a_waiting_request_displaces_lower_priority_ones_for_blocks() -> None:
    """The pool is full of a priority-9 request's blocks: a priority-0 one takes them; a second
    priority-9 one waits."""
    sched, core = prioritized(num_blocks=4)  # 16 tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    low = Request("low", [3] * 13, params, arrival_time=1.0, priority=9)
    high = Request("high", [4] * 8, params, arrival_time=2.0, priority=0)
    later = Request("later", [5] * 8, params, arrival_time=3.0, priority=9)
    got: dict[str, list[int]] = {}
    sched.add_request(low)
    step(core, got)
    assert sched.cache.get_num_free_blocks() == 0
    sched.add_request(later)
    step(core, got)
    assert [r.request_id for r in sched.running] == ["low"] and low.num_preemptions == 0
    sched.add_request(high)
    step(core, got)
    assert [r.request_id for r in sched.running] == ["high"] and low.num_preemptions == 1
    while core.has_work():
        step(core, got)
    for r in (low, high, later):
        assert got[r.request_id] == expected_output(r.prompt_token_ids, params)


@pytest.mark.parametrize("seed, in_flight", [(0, 1), (1, 1), (2, 2), (3, 3), (4, 3)])
def test_arrivals_that_displace_running_requests_keep_every_output_exact(seed: int, in_flight: int) -> None:
    """Requests of random priorities arrive while others run (few seats, a small pool, steps in
    flight): they displace lower ones, and every output is still exactly the unconstrained one."""
    rng = random.Random(seed)
    ex = ScriptedExecutor(14)
    config = SchedulerConfig(24, 3, async_scheduling=in_flight > 1, scheduling_policy="priority")
    sched = Scheduler(config, CacheManager(14, ex.info.block_size), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=in_flight > 1, steps_in_flight=in_flight)
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(1, 90) for _ in range(rng.randrange(2, 20))],
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16), ignore_eos=True),
            arrival_time=float(i),
            priority=rng.randrange(0, 4),
        )
        for i in range(18)
    ]
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    arriving = list(requests)
    while arriving or core.has_work():
        if arriving and (rng.random() < 0.4 or not core.has_work()):
            sched.add_request(arriving.pop(0))
        if core.has_work():
            step(core, got, finished)
    for r in requests:
        assert got[r.request_id] == r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params)
    assert finished.keys() == {r.request_id for r in requests} and sched.num_preemptions > 0


def test_a_displacement_never_leaves_the_step_empty() -> None:
    """``L`` takes every byte of the step, so ``P`` gets none; ``H`` finds the seats taken.
    Displacing ``L`` (its bytes given back, but ``P`` not looked at again) would leave ``H`` short
    of blocks all the same: an empty step, which stops the engine. The room is planned first:
    ``H`` gets in, or ``L`` runs."""
    lp20 = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=20)
    sched = byte_bound(2, 14, lp20)
    _running(sched, "L", [3] * 14, lp20, 9, 0)
    _running(sched, "P", [4] * 60, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0), 0, 40)
    sched.add_request(Request("H", [5] * 30, GREEDY, arrival_time=5.0, priority=0))
    assert sched.decide() == {"L": 14}  # (H would need 8 blocks: the 2 of L's 14 tokens and the 6 free are short)
    sched.cache.check_invariants()


def test_no_request_is_displaced_for_nothing() -> None:
    """``L``'s blocks and the free ones are not enough for ``H``: ``L`` keeps running (preempting
    it would gain ``H`` nothing)."""
    ex = ScriptedExecutor(16)
    sched = Scheduler(SchedulerConfig(64, 8, async_scheduling=False, scheduling_policy="priority"), CacheManager(16, 4), ex.info)
    core = EngineCore(sched, InlineExecutor(ex), async_scheduling=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 20, 2)]
    m, low, high = (
        Request(name, [token] * size, p, arrival_time=float(i), priority=priority)
        for i, (name, token, size, p, priority) in enumerate(
            (("M", 3, 40, params[0], 0), ("L", 4, 8, params[1], 9), ("H", 5, 24, params[2], 0))
        )
    )
    got: dict[str, list[int]] = {}
    sched.add_request(m)
    sched.add_request(low)
    step(core, got)
    step(core, got)
    sched.add_request(high)
    step(core, got)
    assert low.num_preemptions == 0 and [r.request_id for r in sched.waiting] == ["H"]
    while core.has_work():
        step(core, got)
    for r in (m, low, high):
        assert got[r.request_id] == expected_output(r.prompt_token_ids, r.sampling_params)
