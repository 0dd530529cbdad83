"""What one step carries in bytes (`scheduler.step_bytes`): new requests' tokens and sampling
parameters, and prompt logprobs, stay within ``SchedulerConfig.max_step_bytes`` whatever the
token budget allows, so every step and every output message fits the Redis message limit."""

from __future__ import annotations

import pytest

from common.config import SchedulerConfig
from common.protocol import decode, encode
from common.sampling_params import SamplingParams
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.outputs import OutputRouter
from scheduler.request import Request, StepOutput
from scheduler.scheduler import Scheduler
from scheduler.step_bytes import new_request_bytes, prompt_logprob_bytes
from tests.test_engine_client import NAMES
from tests.test_scheduler import ScriptedExecutor, step

pytestmark = pytest.mark.unit

MAX_STEP_BYTES = 6_000


def make(max_model_len: int = 256) -> tuple[Scheduler, ScriptedExecutor, EngineCore]:
    ex = ScriptedExecutor(num_blocks=2048, max_model_len=max_model_len)
    config = SchedulerConfig(4096, 256, max_step_bytes=MAX_STEP_BYTES)
    sched = Scheduler(config, CacheManager(ex.info.num_blocks, ex.info.block_size), ex.info)
    return sched, ex, EngineCore(sched, InlineExecutor(ex))


def test_siblings_of_a_long_prompt_go_to_the_executor_over_several_steps_within_the_byte_budget() -> None:
    sched, ex, core = make()
    prompt = [1 + i % 90 for i in range(200)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    siblings = [Request(f"s{i}", prompt, params, group_id="g") for i in range(32)]  # 32 x 200 tokens
    for r in siblings:
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    while core.has_work():
        step(core, got, finished)
    assert finished == {r.request_id: "length" for r in siblings}  # every one ran
    sizes = [len(encode(o)) for o in ex.outputs]
    # Without the byte budget the token budget (4096) would send the 31 siblings that hit the
    # cached prompt in one step: ~31 x 1 KB. Each step now holds ~5 new ones.
    assert max(sizes) <= MAX_STEP_BYTES, sizes
    assert sum(len(o.new_req_ids) > 0 for o in ex.outputs) >= 32 * new_request_bytes(siblings[0], 4) // MAX_STEP_BYTES


def test_prompt_logprobs_rows_of_a_step_stay_within_the_byte_budget() -> None:
    sched, ex, core = make()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=5)
    requests = [Request(f"p{i}", [1 + (i + j) % 90 for j in range(60)], params) for i in range(4)]  # 60 x 76 B of logprobs each
    for r in requests:
        sched.add_request(r)
    per = prompt_logprob_bytes(requests[0])
    steps = 0
    while out := sched.schedule().scheduled_req_ids and sched.pending[-1]:  # no executor: plan step after step
        steps += 1
        rows = sum(min(n, 60 - start) for _, start, n, _ in out.rows if start < 60)  # prompt positions
        counted = rows * per + sum(new_request_bytes(r, 4) for r, start, _, _ in out.rows if start == 0)
        assert counted <= MAX_STEP_BYTES, ([n for _, _, n, _ in out.rows], counted)
        for r, _, n, _ in out.rows:
            r.prompt_logprobs.extend([{1: -1.0}] * n)  # as if computed
    assert all(len(r.prompt_logprobs) >= 60 for r in requests)  # every prompt went through
    assert steps >= 4  # one prompt's logprobs a step: two would pass the byte budget
    del ex, core


def test_a_request_too_big_for_any_step_is_refused_with_the_reason() -> None:
    sched, _, _ = make(max_model_len=1024)
    prompt = [1 + i % 90 for i in range(400)]
    with pytest.raises(ValueError, match="prompt_logprobs=20 over a prompt of 400 tokens"):
        sched.add_request(Request("big", prompt, SamplingParams(max_tokens=2, prompt_logprobs=20)))
    huge_bias = {t: 1.0 for t in range(2000)}  # its sampling parameters alone pass the budget
    with pytest.raises(ValueError, match="request too large to send in one step"):
        sched.add_request(Request("long", prompt, SamplingParams(max_tokens=2, logit_bias=huge_bias)))
    assert not sched.requests and not sched.waiting


def test_output_messages_are_split_before_they_get_too_big() -> None:
    router = OutputRouter(NAMES, 30.0, max_message_bytes=4_000)
    for i in range(6):
        router.add(f"r{i}", "g1", "")
    big = [{t: -1.0 for t in range(6)}] * 40  # 40 positions x 6 entries: ~2.4 KB of prompt logprobs
    outputs = [
        StepOutput(f"r{i}", [7], [None], False, None, 1, prompt_logprobs=[None, *big] if i % 2 == 0 else None) for i in range(6)
    ]
    sends = router.route(outputs)
    assert len(sends) > 1 and all(len(s.data) <= 4_000 for s in sends)
    assert {s.stream for s in sends} == {NAMES.outputs("g1")}


def test_a_long_resend_with_logprobs_goes_in_pieces_that_fit() -> None:
    router = OutputRouter(NAMES, 30.0, max_message_bytes=200_000)
    router.add("r", "g1", "")
    request = Request("r", [1, 2], SamplingParams(max_tokens=5000, logprobs=20))
    request.output_token_ids = [i % 90 for i in range(5000)]
    request.output_logprobs = [{t: -1.0 for t in range(21)} for _ in range(5000)]  # ~1.3 MB in all
    notice, *sends = router.adopt(request, "r", "g2", 10)  # g1 is told its copy ends
    assert notice.stream == NAMES.outputs("g1") and {s.stream for s in sends} == {NAMES.outputs("g2")}
    assert len(sends) > 1 and all(len(s.data) <= 200_000 for s in sends)
    rows = [(m.token_index[i], m.num_tokens[i]) for m in (decode(s.data) for s in sends) for i in range(len(m.request_ids))]
    assert rows[0][0] == 10 and all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))  # in order, no gap
    assert sum(n for _, n in rows) == 4990


@pytest.mark.parametrize("prompt_len", [100, 115, 120])
def test_two_rows_of_nearly_half_a_message_each_go_in_two_messages(prompt_len: int) -> None:
    limit = 4000
    router = OutputRouter(NAMES, 30.0, max_message_bytes=limit)
    plp = [None] + [{5: -1.0}] * (prompt_len - 1)  # 16 B a position: each row a little under half a message
    for i in range(2):
        router.add(f"r{i}", "g1", "")
    sends = router.route([StepOutput(f"r{i}", [7], [None], False, None, 1, prompt_logprobs=plp) for i in range(2)])
    assert len(sends) == 2 and all(len(s.data) <= limit for s in sends)


def test_a_resend_from_the_start_brings_the_prompt_logprobs_again() -> None:
    router = OutputRouter(NAMES, 30.0, max_message_bytes=1 << 20)
    router.add("r", "g1", "")
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=5, prompt_logprobs=1))
    request.prompt_logprobs, request.prompt_logprobs_sent = [{2: -0.5}, {3: -0.25}], True
    request.output_token_ids, request.output_logprobs = [7, 8], [None, None]
    (send,) = router.adopt(request, "r", "g1", 0)
    assert decode(send.data).prompt_logprobs() == [[None, {2: -0.5}, {3: -0.25}]]
    (send,) = router.adopt(request, "r", "g1", 1)  # from the middle: the gateway has them
    assert not decode(send.data).plp_num
