"""`EngineCore`: the engine loop, shared by the offline `LLM` and the scheduler service.

    output = scheduler.schedule()
    executor.submit(output)                    # on its way; the executor runs steps in order
    ...                                        # with async scheduling, schedule the next one now
    result = executor.collect()                # the oldest step's sampled tokens
    step_outputs = scheduler.update_from_output(output, result)

With ``async_scheduling`` (the default) two steps are in flight: step N+1 is scheduled and sent
while step N runs, so the executor starts N+1 as soon as N ends and the control plane
(scheduling, the Redis round trip, routing outputs) hides behind the forward pass, as long as it
takes less than a step; ``steps_in_flight`` (`SchedulerConfig`) lets more go ahead when it takes
longer. Without async scheduling, each step is scheduled after the previous one's tokens are
applied. Greedy and seeded outputs are the same either way: sampling depends only on the seed and
the output position.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from common.config import ExecutorInfo
from common.protocol import ExecutorOutput, SchedulerOutput
from scheduler.request import StepOutput
from scheduler.scheduler import Scheduler


class StepExecutor(Protocol):
    """Runs the steps it is given, in order (a `ModelExecutor` in process, or one behind Redis)."""

    info: ExecutorInfo

    def submit(self, output: SchedulerOutput) -> None: ...

    def collect(self) -> ExecutorOutput: ...


class ModelExecutorLike(Protocol):
    info: ExecutorInfo

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput: ...

    def reset(self) -> None: ...


class InlineExecutor:
    """A `StepExecutor` over an in-process executor: each step runs when it is submitted.

    Scheduling one ahead still takes effect (step N+1 is decided before N's tokens are applied),
    which keeps the offline engine's scheduling identical to the services'. An executor with
    ``launch``/``collect`` (`ModelExecutor`) has each step launched when submitted and collected
    when its result is, so step N+1 is launched before step N is collected, as in the service."""

    def __init__(self, executor: ModelExecutorLike) -> None:
        self.executor = executor
        self.info = executor.info
        # Per step submitted: its result, its launch handle (collected by the executor), or its error.
        self._results: deque[ExecutorOutput | BaseException | Any] = deque()

    def submit(self, output: SchedulerOutput) -> None:
        if self._results and isinstance(self._results[-1], BaseException):
            self._results.append(self._results[-1])  # after a failed step the rest is void: not run
            return
        try:
            launch = getattr(self.executor, "launch", None)
            self._results.append(launch(output) if launch is not None else self.executor.execute_model(output))
        except Exception as exc:  # raised by `collect`, in step order
            self._results.append(exc)

    def reset(self) -> None:
        """Drop the results not collected and the executor's request state (an interrupted `LLM`)."""
        self._results.clear()
        self.executor.reset()

    def collect(self) -> ExecutorOutput:
        result = self._results.popleft()
        if isinstance(result, BaseException):
            self._results.clear()  # the executor dropped its state; later steps are void
            raise result
        if isinstance(result, ExecutorOutput):
            return result
        try:
            out: ExecutorOutput = self.executor.collect(result)  # type: ignore[attr-defined]
        except Exception:
            self._results.clear()  # the executor dropped its state; later steps are void
            raise
        return out


class EngineCore:
    """Owns a `Scheduler` and a `StepExecutor`; `step` advances the engine by one executed step."""

    def __init__(
        self, scheduler: Scheduler, executor: StepExecutor, async_scheduling: bool = True, steps_in_flight: int = 2
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.depth = steps_in_flight if async_scheduling else 1
        self.in_flight: deque[SchedulerOutput] = deque()
        self.failed_request_ids: list[str] = []  # of the step whose result was an error
        self.collected = False  # whether the last `step` applied an executed step's result

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def step(self) -> list[StepOutput]:
        """Schedule and send a step if fewer than ``depth`` are in flight; then, once the pipeline is
        full (or nothing more could be scheduled), apply the oldest step's result.

        Any error from the executor voids every step in flight: the scheduler preempts its running
        requests and resends them all (the executor dropped its state), then the error is raised."""
        scheduled = False
        self.collected = False
        if len(self.in_flight) < self.depth:
            output = self.scheduler.schedule()
            if output.num_seqs:
                self.executor.submit(output)
                self.in_flight.append(output)
                scheduled = True
            elif not self.in_flight:
                # With a pool that holds max_model_len tokens, a live request can always be scheduled.
                assert not self.scheduler.requests, "scheduler stalled with live requests"
                return []
        if not self.in_flight or (scheduled and len(self.in_flight) < self.depth):
            return []
        output = self.in_flight.popleft()
        try:
            result = self.executor.collect()
        except BaseException:
            self.failed_request_ids = list(output.scheduled_req_ids)
            self.reset()
            raise
        self.collected = True
        return self.scheduler.update_from_output(output, result)

    def reset(self) -> None:
        """Forget the steps in flight (the executor lost them); requests are kept and recomputed."""
        self.in_flight.clear()
        self.scheduler.executor_lost()
