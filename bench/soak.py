"""Soak: does anything grow without bound? Redis memory and keys, and every process's RSS.

    python -m bench.soak --warmup 300 --requests 2000 --concurrency 32

A real stack (private redis-server, one engine, one gateway, the tiny model) serves a warm-up, then
the measured requests in rounds (half streamed, half not; varied prompts and lengths). After each
round it waits out the resume window (journals of finished streams live that long by design) and
records Redis ``used_memory``, the number of keys, and the RSS of each process. Bounded means: the
last round's Redis memory is within 1 MB of the warm-up's, the key count is the same, and RSS
stops growing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from infra.stack import Stack

RESUME_WINDOW_S = 3.0


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load(url: str, n: int, concurrency: int, seed: int) -> int:
    """Send ``n`` requests, ``concurrency`` at a time; returns the completion tokens received."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    received = 0

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        nonlocal received
        prompt = " ".join(f"w{rng.randrange(500)}" for _ in range(rng.randrange(1, 60)))
        kwargs: dict[str, Any] = dict(
            model="", prompt=prompt, max_tokens=rng.randrange(4, 24), temperature=0.8, seed=i, extra_body={"ignore_eos": True}
        )
        async with sem:
            if i % 2:
                r = await client.completions.create(**kwargs)
                received += r.usage.completion_tokens
            else:
                stream = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.usage:
                        received += chunk.usage.completion_tokens

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        await asyncio.gather(*(one(client, i) for i in range(n)))
    return received


def snapshot(stack: Stack, label: str, tokens: int) -> dict[str, float | int | str]:
    time.sleep(RESUME_WINDOW_S + 1.5)  # finished streams' journals expire
    memory = stack.redis.info("memory")["used_memory"]
    row: dict[str, float | int | str] = {
        "after": label,
        "tokens": tokens,
        "redis_used_mb": round(memory / 2**20, 3),
        "keys": stack.redis.dbsize(),
    }
    for name, proc in stack.procs.items():
        row[f"{name}_rss_mb"] = round(rss_mb(proc.pid), 1)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args(argv)
    from executor.make_model import cached_model

    window = ("--resume-window", str(RESUME_WINDOW_S))
    stack = Stack(
        cached_model("llama", "tiny"),
        Path(tempfile.mkdtemp(prefix="conveyor-soak-")),
        private_redis=True,
        executor_args=("--num-blocks", "1024"),
        scheduler_args=window,
        gateway_args=window,
    )
    stack.start()
    rows = []
    try:
        url = stack.urls[0]
        rows.append(snapshot(stack, f"warm-up ({args.warmup})", asyncio.run(load(url, args.warmup, args.concurrency, 0))))
        per_round = args.requests // args.rounds
        done = 0
        for k in range(args.rounds):
            tokens = asyncio.run(load(url, per_round, args.concurrency, k + 1))
            done += per_round
            rows.append(snapshot(stack, f"+{done}", tokens))
    finally:
        stack.stop()
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    grew = float(rows[-1]["redis_used_mb"]) - float(rows[0]["redis_used_mb"])
    print(
        f"Redis memory {grew:+.3f} MB and keys {int(rows[-1]['keys']) - int(rows[0]['keys']):+d} after {done} requests",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
