"""What the stack and the engine report during `conveyor bench serve`: step sums, CPU, in-process runs."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from bench.serve_data import BenchRequest


# -- what the stack and the engine report ------------------------------------------------------
def read_stats(redis_url: str, namespace: str, scheduler_id: str = "0", settle_s: float = 0.0) -> Any:
    """The `EngineStatus` of one engine (its step timing sums). With ``settle_s``, the first one
    published that long after the call (the engine publishes a beat or two after its last step),
    so the sums include the steps that just ended."""
    import redis

    from common.protocol import EngineStatus, Names, decode

    r, names = redis.Redis.from_url(redis_url), Names(namespace)
    since = time.time() + settle_s
    deadline = time.monotonic() + settle_s + 5.0
    while True:
        status = decode(cast(bytes, r.get(names.engine(scheduler_id))), (EngineStatus,))
        if status.updated_at >= since or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def step_breakdown(before: Any, after: Any) -> dict[str, float]:
    """Mean engine step between two `EngineStatus` reads, and its part outside ``execute_model``."""
    n = after.step_count - before.step_count
    wall = after.step_wall_s - before.step_wall_s
    fwd = after.step_forward_s - before.step_forward_s
    if n <= 0:
        return {"steps": 0}
    return {"steps": n, "step_ms": 1e3 * wall / n, "execute_ms": 1e3 * fwd / n, "outside_execute_ms": 1e3 * (wall - fwd) / n}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (Linux ``/proc``), this one as "client"."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, pid in {**pids, "client": os.getpid()}.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def offline_breakdown(
    model: str,
    requests: Sequence[BenchRequest],
    ignore_eos: bool,
    engine_kw: dict[str, Any],
    concurrency: int,
    chat: bool = False,
) -> dict[str, float]:
    """The same requests in-process (``concurrency`` per `generate` call; arrival times are not
    reproduced), with timers around the executor's steps (launch and collect), the forward pass and
    sampling."""
    from common.sampling_params import SamplingParams
    from gateway.llm import LLM

    llm = LLM(model, **engine_kw)
    prompts: list[Any] = [r.prompt for r in requests]  # token ids or text, as sent
    if chat:  # as the gateway renders a one-message chat
        tok = llm.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": str(p)}], tokenize=False, add_generation_prompt=True)
            if getattr(tok, "chat_template", None)
            else f"user: {p}\nassistant:"
            for p in prompts
        ]
    from executor.model_executor import ModelExecutor

    ex = llm.executor
    assert isinstance(ex, ModelExecutor), "the engine timings are of a single-rank executor"
    timers = {"execute": 0.0, "forward": 0.0, "sample": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t

        return wrapper

    ex.launch = timed("execute", ex.launch)  # type: ignore[method-assign]
    ex.collect = timed("execute", ex.collect)  # type: ignore[method-assign]
    ex.model.forward = timed("forward", ex.model.forward)  # type: ignore[method-assign]
    ex.sampler.sample = timed("sample", ex.sampler.sample)  # type: ignore[method-assign]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.reset_prefix_cache()  # as the stack: the timed run finds only what it caches itself
    for key in timers:
        timers[key] = 0.0
    steps0 = llm.scheduler.num_steps
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=ignore_eos) for r in requests]
    t = time.perf_counter()
    results = []
    for i in range(0, len(prompts), concurrency):
        results += llm.generate(prompts[i : i + concurrency], params[i : i + concurrency])
    elapsed = time.perf_counter() - t
    steps = max(llm.scheduler.num_steps - steps0, 1)
    produced = sum(len(r.token_ids) for r in results)
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "steps": steps,
        "step_ms": 1e3 * elapsed / steps,
        "execute_ms": 1e3 * timers["execute"] / steps,
        "forward_ms": 1e3 * timers["forward"] / steps,
        "sample_ms": 1e3 * timers["sample"] / steps,
        "outside_execute_ms": 1e3 * (elapsed - timers["execute"]) / steps,
    }
