"""A model-free executor for scheduler tests: the real executor state, a scripted forward pass."""

from __future__ import annotations

from common.config import ExecutorInfo
from common.protocol import ExecutorOutput, SchedulerOutput
from executor.input_batch import Batch, PersistentBatch


class FakeExecutor:
    """Keeps each request's state in a `PersistentBatch` as `ModelExecutor` does (and drops it
    all when a step fails); subclasses say which token each sampling row gets (`run_batch`).
    Records every step and batch it ran."""

    def __init__(self, info: ExecutorInfo) -> None:
        self.info = info
        self.state = PersistentBatch(info.block_size, info.vocab_size)
        self.outputs: list[SchedulerOutput] = []
        self.batches: list[Batch] = []

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        try:
            batch = self.state.prepare(output)
            self.outputs.append(output)
            self.batches.append(batch)
            token_ids = self.run_batch(batch)
            self.state.append_sampled(batch, token_ids)
        except BaseException:
            self.state.clear()  # as `ModelExecutor` does: the scheduler resends every request
            raise
        return ExecutorOutput(token_ids, [None] * len(token_ids))

    def reset(self) -> None:
        self.state.clear()

    def run_batch(self, batch: Batch) -> list[int]:
        """The token of each row of ``batch`` (-1 where it does not sample)."""
        raise NotImplementedError
