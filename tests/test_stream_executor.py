"""`StreamExecutor` against real Redis, with the test playing the executor: steps leave in order,
and results that arrive together (one read returning two) lose nothing that was queued."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common.config import ExecutorInfo
from common.protocol import ENTRY_FIELD, Names, SchedulerOutput, StepResult, decode, encode
from common.transport import Outgoing
from infra.stack import find_redis
from scheduler.stream_executor import StepFailed, StreamExecutor
from tests.redis_servers import private_namespace

pytestmark = pytest.mark.stack

EPOCH = 7


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[redis.Redis, Names, StreamExecutor]]:
    with private_namespace(tmp_path, "se") as (r, names, transport):
        info = ExecutorInfo("m", 16, 4, 64, [0], 100)
        executor = StreamExecutor(
            info, transport, scheduler_id="0", executor_id="e", epoch=EPOCH, results_cursor=b"0-0", result_timeout_s=5
        )
        yield r, names, executor


def step(n: int, request_ids: list[str]) -> SchedulerOutput:
    out = SchedulerOutput(step=n)
    for rid in request_ids:
        out.add_scheduled(rid, 1, 0, False)
    return out


def sent_steps(r: redis.Redis, names: Names) -> list[int]:
    entries: Any = r.xrange(names.steps("0"))
    return [decode(e[ENTRY_FIELD]).step for _, e in entries]


def answer(r: redis.Redis, names: Names, n: int, tokens: list[int], error: str | None = None) -> None:
    r.xadd(names.results("0"), {ENTRY_FIELD: encode(StepResult(epoch=EPOCH, step=n, token_ids=tokens, error=error))})


def test_results_read_together_lose_no_queued_step_or_output(env: tuple[redis.Redis, Names, StreamExecutor]) -> None:
    r, names, executor = env
    executor.submit(step(1, ["a"]))
    executor.submit(step(2, ["a", "b"]))
    answer(r, names, 1, [5])
    answer(r, names, 2, [6, 7])  # both results are there when step 1's is read: step 2's is kept
    assert executor.collect().token_ids == [5]
    assert sent_steps(r, names) == [1, 2]
    executor.submit(step(3, ["b"]))
    executor.outbox.append(Outgoing(names.outputs("gw"), b"payload", 10))
    assert executor.collect().token_ids == [6, 7]  # from the early result, yet step 3 must leave now
    assert sent_steps(r, names) == [1, 2, 3]
    assert r.xlen(names.outputs("gw")) == 1
    answer(r, names, 3, [8])
    assert executor.collect().token_ids == [8]
    assert not executor.in_flight and not executor.early


def test_a_step_error_is_step_failed_and_rebind_starts_a_new_epoch(env: tuple[redis.Redis, Names, StreamExecutor]) -> None:
    r, names, executor = env
    executor.submit(step(1, ["a"]))
    executor.submit(step(2, ["a"]))
    answer(r, names, 1, [], error="boom")
    with pytest.raises(StepFailed, match="boom"):
        executor.collect()
    executor.rebind(EPOCH + 1)
    assert not executor.in_flight and executor.epoch == EPOCH + 1
    executor.flush()
    entries: Any = r.xrange(names.steps("0"))
    last = decode(entries[-1][1][ENTRY_FIELD])
    assert (type(last).__name__, last.epoch, last.executor_id) == ("BindExecutor", EPOCH + 1, "e")


def test_a_burst_beyond_the_pool_waits_instead_of_failing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """More concurrent calls than pooled connections (a gateway under a burst of requests) wait
    for a connection: none fails with "Too many connections" and none is retried with backoff."""
    import asyncio

    from common.transport import CLIENT_OPTIONS, Transport

    url, proc = find_redis(tmp_path)

    async def burst() -> list[Any]:
        t = Transport(url, Names("test-pool"), owner="test")
        try:
            # BLPOP on a missing key holds its connection for 50 ms: all 64 are busy at once.
            calls = [
                t.call(t.redis.blpop, [f"test-pool:none:{i}"], 0.05, deadline_s=5)
                for i in range(3 * CLIENT_OPTIONS["max_connections"])
            ]
            return await asyncio.gather(*calls)
        finally:
            await t.close()

    try:
        assert asyncio.run(burst()) == [None] * (3 * CLIENT_OPTIONS["max_connections"])
        assert "redis unavailable" not in caplog.text
    finally:
        if proc is not None:
            proc.terminate()
