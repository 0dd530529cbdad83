"""A request that makes the executor's step fail is failed alone; the others in the step go on.

The scheduler and executor services run in this process on threads, against real Redis, with a
real `ModelExecutor` whose ``execute_model`` raises whenever the batch holds the poisoned request
(as a bad kernel input or a sampler bug would). The test plays the gateway on the streams.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import redis

from common.config import CacheConfig, ModelConfig, ParallelConfig
from common.protocol import EngineStatus, GenerateRequest, Names, StepOutputs, decode, encode
from executor.service import ExecutorService, ExecutorServiceConfig
from scheduler.service import SchedulerService, SchedulerServiceConfig
from infra.stack import find_redis


class PoisonedExecutor:
    """A real `ModelExecutor` that fails every step holding a request whose id contains 'poison'."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info
        self.failed_steps = 0

    def execute_model(self, batch: Any) -> Any:
        if any("poison" in r for r in batch.request_ids):
            self.failed_steps += 1
            raise RuntimeError("poisoned request in the batch")
        return self.inner.execute_model(batch)


def test_failing_request_fails_alone(tiny_model: Any, tmp_path: Any) -> None:
    from executor.model_executor import ModelExecutor
    from scheduler import LLM

    url, proc = find_redis(tmp_path)
    assert proc is None or proc.poll() is None
    names = Names(f"test-{uuid.uuid4().hex[:10]}")
    r = redis.Redis.from_url(url)
    model = str(tiny_model())
    poisoned = PoisonedExecutor(ModelExecutor(ModelConfig(model), ParallelConfig(), CacheConfig(num_blocks=128)))
    executor = ExecutorService(ExecutorServiceConfig(url, model, names.namespace, heartbeat_ttl_ms=1500), poisoned)
    scheduler = SchedulerService(SchedulerServiceConfig(url, names.namespace, heartbeat_ttl_ms=1500))
    threads = [threading.Thread(target=s.run, daemon=True) for s in (executor, scheduler)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (status := r.get(names.engine("0"))) or not decode(status, (EngineStatus,)).executor_id:
            assert time.monotonic() < deadline, "the engine never came up"
            time.sleep(0.05)
        incarnation = decode(status, (EngineStatus,)).incarnation
        r.set(names.heartbeat("gateway", "gw"), "1", px=60_000)
        greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
        prompts = {"a": [5, 6, 7], "poison": [8, 9], "b": [10, 11, 12, 13], "c": [14]}
        for request_id, prompt in prompts.items():
            msg = GenerateRequest(request_id, "gw", "0", incarnation, prompt, [], greedy, 0.0)
            r.xadd(names.requests("0"), {b"m": encode(msg)})
        tokens: dict[str, list[int]] = {k: [] for k in prompts}
        ends: dict[str, tuple[str | None, str | None]] = {}
        cursor = "0-0"
        while len(ends) < len(prompts):
            assert time.monotonic() < deadline + 30, f"requests never finished: {ends}"
            for _, entries in r.xread({names.outputs("gw"): cursor}, block=1000) or []:
                for entry_id, entry in entries:
                    cursor = entry_id
                    out = decode(entry[b"m"], (StepOutputs,))
                    pos = 0
                    for i, request_id in enumerate(out.request_ids):
                        n = out.num_tokens[i]
                        assert out.token_index[i] <= len(tokens[request_id])
                        new = out.token_ids[pos : pos + n][len(tokens[request_id]) - out.token_index[i]:]
                        tokens[request_id].extend(new)
                        pos += n
                        if out.finished[i]:
                            ends[request_id] = (out.finish_reasons[i], out.errors[i])
        assert ends["poison"][0] == "error" and "poisoned request" in (ends["poison"][1] or "")
        assert tokens["poison"] == []
        llm = LLM(model, num_blocks=128)
        from common.sampling_params import SamplingParams

        for request_id in ("a", "b", "c"):
            assert ends[request_id] == ("length", None)
            want = llm.generate([prompts[request_id]], SamplingParams(**greedy))[0].token_ids
            assert tokens[request_id] == want, request_id
        assert poisoned.failed_steps >= 2  # the mixed step, then the poisoned request alone
    finally:
        scheduler.stop()
        executor.stopping.set()
        for thread in threads:
            thread.join(10)
        keys = list(r.scan_iter(match=f"{names.namespace}:*"))
        if keys:
            r.delete(*keys)
