"""Steps launched one ahead of their collection (`ModelExecutor.launch` / `collect`), and the
executor service's order of launches, collections and results: token for token what running each
step whole gives, with the tokens of a step not yet read back filled in on the device."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from common.config import CacheConfig, ModelConfig, ParallelConfig
from common.protocol import BindExecutor, ExecutorOutput, SchedulerOutput, StepResult, decode, encode
from common.sampling_params import SamplingParams
from executor.model_executor import LaunchedStep, ModelExecutor
from executor.service import ExecutorService

BLOCK = 4
MAX_BLOCKS = 8  # per request: room for its prompt and every token it decodes here


def make_executor(path: Path) -> ModelExecutor:
    return ModelExecutor(
        ModelConfig(str(path), dtype="float32", device="cpu", max_model_len=64),
        ParallelConfig(),
        CacheConfig(block_size=BLOCK, num_blocks=64),
    )


class Scheduler:
    """Steps as a scheduler running one ahead sends them: a request's next step reads the token its
    previous step samples, which the scheduler does not know yet (the executor fills it in)."""

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        self.known: dict[str, int] = {}
        self.next_block = 0
        self.steps = 0

    def step(
        self,
        new: dict[str, tuple[list[int], SamplingParams]],
        decodes: list[str],
        finished: list[str] = (),  # type: ignore[assignment]
        chunks: dict[str, int] | None = None,
    ) -> SchedulerOutput:
        """``new`` prompts prefilled (``chunks``: only that many of its tokens, without sampling),
        ``decodes`` one token each (or the rest of a chunked prompt), ``finished`` dropped first."""
        self.steps += 1
        out = SchedulerOutput(step=self.steps, epoch=1, finished_req_ids=list(finished))
        for rid, (tokens, params) in new.items():
            blocks = list(range(self.next_block, self.next_block + MAX_BLOCKS))
            self.next_block += MAX_BLOCKS
            out.add_new(rid, params, len(tokens), tokens, blocks)
            self.computed[rid], self.known[rid] = 0, len(tokens)
        decodes = [*new, *decodes]
        for rid in decodes:
            start = self.computed[rid]
            n = (chunks or {}).get(rid, self.known[rid] - start)
            sample = start + n == self.known[rid]
            out.add_scheduled(rid, n, start, sample)
            self.computed[rid] = start + n
            self.known[rid] += int(sample)
        return out


def conversation(logprobs: int | None) -> list[SchedulerOutput]:
    """Prefills, a chunked prefill, decodes, a request joining and one finishing (its row moves)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=logprobs)
    s = Scheduler()
    steps = [
        s.step({"a": ([5, 9, 2, 7, 1], greedy), "b": ([3, 4, 8, 8, 6, 1, 2, 9, 5], other)}, []),
        s.step({"c": ([11, 12, 13, 14, 15, 16, 17], greedy)}, ["a", "b"], chunks={"c": 4}),
        s.step({}, ["a", "b", "c"]),
        s.step({"d": ([21, 22, 23], greedy)}, ["a", "b", "c"]),
        s.step({}, ["b", "c", "d"], finished=["a"]),
    ]
    steps += [s.step({}, ["b", "c", "d"]) for _ in range(4)]
    return steps


def run_whole(ex: ModelExecutor, steps: list[SchedulerOutput]) -> list[ExecutorOutput]:
    return [ex.execute_model(decode(encode(out))) for out in steps]


def run_ahead(ex: ModelExecutor, steps: list[SchedulerOutput]) -> tuple[list[ExecutorOutput], list[bool]]:
    """Each step launched before the one before it is collected; also whether each step's tokens
    were still on the device when the next one launched."""
    results: list[ExecutorOutput] = []
    deferred: list[bool] = []
    before: LaunchedStep | None = None
    for out in steps:
        launched = ex.launch(decode(encode(out)))
        if before is not None:
            deferred.append(before.on_device)
            results.append(ex.collect(before))
        before = launched
    assert before is not None
    results.append(ex.collect(before))
    return results, deferred


@pytest.mark.model
@pytest.mark.parametrize("logprobs", [None, 2])
def test_launching_ahead_is_token_exact(tiny_model, logprobs: int | None) -> None:
    """Without logprobs every step leaves its tokens on the device and the next reads them there;
    with a request asking for logprobs, sampling is on the host and each step's tokens are read
    back before the next launches. Either way the tokens (and logprobs) are those of running each
    step whole, and so are the tokens each request holds afterwards."""
    path = tiny_model("llama")
    steps = conversation(logprobs)
    whole_ex, ahead_ex = make_executor(path), make_executor(path)
    whole = run_whole(whole_ex, steps)
    ahead, deferred = run_ahead(ahead_ex, steps)
    assert [r.token_ids for r in ahead] == [r.token_ids for r in whole]
    assert [r.logprobs for r in ahead] == [r.logprobs for r in whole]
    assert all(t >= 0 for r in whole[2:] for t in r.token_ids)  # every decode sampled
    assert deferred == [logprobs is None] * (len(steps) - 1)
    for rid in "bcd":
        assert ahead_ex.input_batch.tokens(rid).tolist() == whole_ex.input_batch.tokens(rid).tolist()
    assert not ahead_ex._pending


@pytest.mark.model
def test_placeholders_are_the_tokens_of_the_step_before(tiny_model) -> None:
    """A launched step holds 0 where the step before's tokens go until it is collected; the step
    launched behind it takes them from the device: its input ids are the real tokens."""
    ex = make_executor(tiny_model("llama"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    s = Scheduler()
    first = ex.launch(s.step({"a": ([5, 9, 2, 7, 1], greedy), "b": ([3, 4, 8], greedy)}, []))
    assert first.on_device
    assert ex.input_batch.tokens("a").tolist() == [5, 9, 2, 7, 1, 0]  # its place held
    second_out = s.step({}, ["a", "b"])
    batch = ex.input_batch.prepare(second_out)  # what the next launch sees on the host
    holes = ex._placeholders(batch)
    assert holes is not None and holes.source is first
    assert holes.token_index.tolist() == [0, 1] and holes.sampled_index.tolist() == [0, 1]
    ex.reset()

    ex2 = make_executor(tiny_model("llama"))
    s = Scheduler()
    first = ex2.launch(s.step({"a": ([5, 9, 2, 7, 1], greedy), "b": ([3, 4, 8], greedy)}, []))
    second = ex2.launch(s.step({}, ["a", "b"]))
    sampled = ex2.collect(first).token_ids
    assert ex2.input_batch.tokens("a").tolist()[:6] == [5, 9, 2, 7, 1, sampled[0]]
    assert ex2.input_batch.tokens("b").tolist()[:4] == [3, 4, 8, sampled[1]]
    ex2.collect(second)
    assert len(ex2.input_batch.tokens("a")) == 7 and not ex2._pending


@pytest.mark.model
def test_a_failed_launch_drops_the_state_and_the_step_before_still_collects(tiny_model) -> None:
    ex = make_executor(tiny_model("llama"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    s = Scheduler()
    first = ex.launch(s.step({"a": ([5, 9, 2, 7, 1], greedy)}, []))
    bad = SchedulerOutput(step=2, epoch=1)
    bad.add_scheduled("nobody", 1, 0, True)
    with pytest.raises(ValueError, match="unknown request"):
        ex.launch(bad)
    assert not ex.input_batch.requests and not ex._pending
    assert ex.collect(first).token_ids[0] >= 0


class RecordingModel:
    """Stands in for `ModelExecutor` in the service: records launches and collections."""

    def __init__(self, fail_collect: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail_collect = fail_collect

    def launch(self, output: SchedulerOutput) -> int:
        self.calls.append(("launch", output.step))
        return output.step

    def collect(self, step: int) -> ExecutorOutput:
        self.calls.append(("collect", step))
        if step == self.fail_collect:
            raise RuntimeError("injected")
        return ExecutorOutput([100 + step], [])

    def reset(self) -> None:
        self.calls.append(("reset", 0))

    def check_device(self) -> None:
        pass


def service(model: Any) -> ExecutorService:
    svc = ExecutorService.__new__(ExecutorService)
    svc.model = model
    svc.eid = "e"
    svc.epoch = 1
    svc.last_step = 0
    svc.in_flight = None
    svc.transport = SimpleNamespace(encode=encode)  # type: ignore[assignment]
    return svc


def step_msg(n: int) -> SchedulerOutput:
    out = SchedulerOutput(step=n, epoch=1)
    out.add_scheduled("r", 1, n, True)
    return out


def results_of(sends: list[Any]) -> list[StepResult]:
    return [decode(s.data) for s in sends]


@pytest.mark.unit
def test_service_launches_the_next_step_before_collecting() -> None:
    """Queued steps: step N+1 is launched before step N is collected; results leave in order, the
    last one when it is flushed (nothing queued behind it), and before a new binding resets."""
    model = RecordingModel()
    svc = service(model)
    sends: list[Any] = []
    for n in (1, 2, 3):
        svc._handle(step_msg(n), "results", sends)
    assert model.calls == [("launch", 1), ("launch", 2), ("collect", 1), ("launch", 3), ("collect", 2)]
    svc._flush("results", sends)
    assert [(r.step, r.token_ids, r.error) for r in results_of(sends)] == [(1, [101], None), (2, [102], None), (3, [103], None)]
    svc._handle(step_msg(4), "results", sends)
    svc._handle(BindExecutor("e", "s", 2), "results", sends)
    assert model.calls[-3:] == [("launch", 4), ("collect", 4), ("reset", 0)]
    assert results_of(sends)[-1].step == 4


@pytest.mark.unit
def test_service_drops_the_step_behind_a_failed_collection() -> None:
    """Step 1 fails when collected, after step 2 was launched: step 1 reports the error, the
    state is dropped, and step 2 (built on that state) reports nothing; the epoch is over."""
    model = RecordingModel(fail_collect=1)
    svc = service(model)
    sends: list[Any] = []
    svc._handle(step_msg(1), "results", sends)
    svc._handle(step_msg(2), "results", sends)
    svc._flush("results", sends)
    results = results_of(sends)
    assert [(r.step, r.error) for r in results] == [(1, "RuntimeError: injected")]
    assert svc.epoch is None and svc.in_flight is None
    assert ("reset", 0) in model.calls


@pytest.mark.unit
def test_service_runs_whole_steps_of_a_model_without_launch() -> None:
    """A model with only ``execute_model`` (a test double, say) still runs, one whole step at a time."""
    ran: list[int] = []

    def execute_model(output: SchedulerOutput) -> ExecutorOutput:
        ran.append(output.step)
        return ExecutorOutput([7], [])

    svc = service(SimpleNamespace(execute_model=execute_model, reset=lambda: None, check_device=lambda: None))
    sends: list[Any] = []
    svc._handle(step_msg(1), "results", sends)
    svc._handle(step_msg(2), "results", sends)
    svc._flush("results", sends)
    assert ran == [1, 2] and [r.token_ids for r in results_of(sends)] == [[7], [7]]
