"""HTTP streaming load against a running stack, and where an engine step's time goes.

    python -m bench.serve --start --model DIR              # start a private stack, then measure
    python -m bench.serve --url http://127.0.0.1:8000 --redis-url ... --namespace ...

Sends bench.offline's workload (token-id prompts, greedy, ``ignore_eos``) as streaming
completions, all at once or under ``--max-concurrency``, and reports output tokens/s, TTFT and
inter-token latency. With the scheduler's stats key (``--redis-url``/``--namespace``, automatic
with ``--start``) it also reports the mean step time and the share spent outside the executor's
``execute_model`` (scheduling, delta encoding, Redis round trip). ``--offline`` runs the same work
in-process through `LLM` and splits its step into scheduling, forward pass and sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, cast

import httpx

from bench.offline import make_workload, prompt_ids


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> tuple[float, list[float], int]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("choices"):
                stamps.append(time.perf_counter() - t0)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (stamps[0] if stamps else float("nan")), stamps, tokens


async def http_load(url: str, prompts: list[list[int]], outs: list[int], concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # Warm-up: one burst of short requests at the full concurrency (connections, worker threads).
        await asyncio.gather(*(_one(client, url, p[:8], 2) for p in prompts[:concurrency]))

        async def run(p: list[int], n: int) -> tuple[float, list[float], int]:
            async with sem:
                return await _one(client, url, p, n)

        t = time.perf_counter()
        results = await asyncio.gather(*(run(p, n) for p, n in zip(prompts, outs)))
        elapsed = time.perf_counter() - t
    produced = sum(r[2] for r in results)
    assert produced == sum(outs), (produced, sum(outs))
    itl = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
    ttft = [r[0] for r in results]
    return {"elapsed_s": elapsed, "output_tokens": produced, "tokens_per_s": produced / elapsed,
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "itl_p50_ms": 1e3 * statistics.median(itl) if itl else 0.0,
            "itl_p99_ms": 1e3 * sorted(itl)[int(0.99 * (len(itl) - 1))] if itl else 0.0}


def read_stats(redis_url: str, namespace: str, scheduler_id: str = "0") -> Any:
    """The `EngineStatus` of one engine (its step timing sums)."""
    import redis

    from common.protocol import EngineStatus, Names, decode

    r, names = redis.Redis.from_url(redis_url), Names(namespace)
    return decode(cast(bytes, r.get(names.engine(scheduler_id))), (EngineStatus,))


def offline_breakdown(model: str, prompts: list[list[int]], outs: list[int], engine_kw: dict[str, Any],
                      concurrency: int) -> dict[str, float]:
    """In-process run (``concurrency`` prompts per `generate` call) with timers around
    execute_model, the forward pass and sampling."""
    from common.sampling_params import SamplingParams
    from scheduler.llm import LLM

    llm = LLM(model, **engine_kw)
    ex = llm.executor
    timers = {"execute": 0.0, "forward": 0.0, "sample": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    ex.execute_model = timed("execute", ex.execute_model)  # type: ignore[method-assign]
    ex.model.forward = timed("forward", ex.model.forward)  # type: ignore[method-assign]
    ex.sampler.sample = timed("sample", ex.sampler.sample)  # type: ignore[method-assign]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for key in timers:
        timers[key] = 0.0
    steps0 = llm.scheduler.num_steps
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    results = []
    for i in range(0, len(prompts), concurrency):
        results += llm.generate(prompts[i : i + concurrency], params[i : i + concurrency])
    elapsed = time.perf_counter() - t
    steps = llm.scheduler.num_steps - steps0
    produced = sum(len(r.token_ids) for r in results)
    return {"elapsed_s": elapsed, "tokens_per_s": produced / elapsed, "steps": steps,
            "step_ms": 1e3 * elapsed / steps, "execute_ms": 1e3 * timers["execute"] / steps,
            "forward_ms": 1e3 * timers["forward"] / steps, "sample_ms": 1e3 * timers["sample"] / steps,
            "outside_execute_ms": 1e3 * (elapsed - timers["execute"]) / steps}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="gateway base URL of a running stack")
    p.add_argument("--start", action="store_true", help="start a private stack (needs --model)")
    p.add_argument("--model", help="checkpoint directory (for --start / --offline)")
    p.add_argument("--redis-url")
    p.add_argument("--namespace")
    p.add_argument("--workload", default="uniform", choices=["uniform", "mixed"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None, help="override every request's output length")
    p.add_argument("--max-concurrency", type=int, default=0, help="0: all requests at once")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--offline", action="store_true", help="also run the same work in-process (LLM)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra scheduler flag for --start (repeatable), e.g. --scheduler-arg=--no-async-scheduling")
    args = p.parse_args(argv)

    work = make_workload(args.workload, args.num_requests)
    outs = [args.output_len or n for n in work.output_lens]
    prompts = prompt_ids(work, args.vocab, 8)
    concurrency = args.max_concurrency or len(prompts)
    stack = None
    if args.start:
        import tempfile

        from infra.stack import Stack

        extra = ("--num-blocks", str(args.num_blocks)) if args.num_blocks else ()
        stack = Stack(args.model, Path(tempfile.mkdtemp(prefix="bench-serve-")), executor_args=extra,
                      scheduler_args=tuple(args.scheduler_arg)).start()
        args.url, args.redis_url, args.namespace = stack.urls[0], stack.redis_url, stack.namespace
    try:
        before = read_stats(args.redis_url, args.namespace) if args.redis_url else None
        pids = {name: proc.pid for name, proc in stack.procs.items()} if stack is not None else {}
        cpu0 = cpu_seconds(pids)
        http = asyncio.run(http_load(args.url, prompts, outs, concurrency))
        cpu1 = cpu_seconds(pids)
        report: dict[str, Any] = {"workload": work.name, "requests": len(prompts), "concurrency": concurrency, "http": http}
        # Where the machine's CPU went during the load (the warm-up burst included).
        report["cpu_s"] = {name: round(cpu1[name] - cpu0[name], 3) for name in cpu1 if name in cpu0}
        if before is not None:
            after = read_stats(args.redis_url, args.namespace)
            n = after.step_count - before.step_count
            wall = after.step_wall_s - before.step_wall_s
            fwd = after.step_forward_s - before.step_forward_s
            report["service_steps"] = {"steps": n, "step_ms": 1e3 * wall / n, "execute_ms": 1e3 * fwd / n,
                                       "outside_execute_ms": 1e3 * (wall - fwd) / n}
    finally:
        if stack is not None:
            stack.stop()
    if args.offline:
        kw = {"num_blocks": args.num_blocks} if args.num_blocks else {}
        report["offline"] = offline_breakdown(args.model, prompts, outs, kw, concurrency)
        report["http_vs_offline"] = report["http"]["tokens_per_s"] / report["offline"]["tokens_per_s"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
