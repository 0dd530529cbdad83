"""Executor memory under continuous batching: RSS after every N requests, in one process.

    python -m bench.executor_rss --requests 3000                # RSS should plateau
    python -m bench.executor_rss --requests 3000 --exact-rows   # the old behaviour: it keeps growing

Drives the offline `LLM` (the very scheduler and `ModelExecutor` the services use) with waves of
1-100 requests of 1-300 prompt tokens and 1-64 output tokens, greedy and sampled, some with
logprobs, so steps mix prefill chunks and decodes of ever-different sizes. ``--exact-rows`` turns
off the row bucketing of packed CPU linears (`executor.layers.linear.row_bucket`): every new token count
then builds and caches another oneDNN primitive (~0.55 MB each).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from common import SamplingParams
from executor.make_model import cached_model

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """Resident set size of this process in MiB (from /proc, no psutil needed)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def make_wave(rng: random.Random, vocab: int, max_wave: int) -> tuple[list[list[int]], list[SamplingParams]]:
    n = rng.randint(1, max_wave)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(n)]
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.8]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 0, 20]),
            max_tokens=rng.randint(1, 64),
            ignore_eos=True,
            seed=rng.choice([None, rng.randrange(1 << 20)]),
            logprobs=rng.choice([None, None, 0, 5]),
        )
        for _ in range(n)
    ]
    return prompts, params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--every", type=int, default=250, help="print RSS after about this many requests")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the cached tiny llama)")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-wave", type=int, default=100, help="most requests submitted together")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact-rows", action="store_true", help="disable row bucketing (shows the leak)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.exact_rows:
        import executor.layers.linear

        executor.layers.linear.row_bucket = lambda rows: rows
    from scheduler import LLM

    model = args.model or str(cached_model("llama", args.size))
    llm = LLM(
        model,
        dtype="float32",
        device="cpu",
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    rng = random.Random(args.seed)
    vocab = llm.executor.info.vocab_size
    start = rss_mb()
    print(f"model {model}, {args.threads} thread(s), exact rows: {args.exact_rows}")
    print(f"{'requests':>8} {'rss MiB':>9} {'delta':>8} {'s':>6}")
    print(f"{0:8d} {start:9.1f} {0.0:8.1f} {0.0:6.0f}", flush=True)
    t0, done, next_print, marks = time.perf_counter(), 0, args.every, []
    while done < args.requests:
        prompts, params = make_wave(rng, vocab, args.max_wave)
        llm.generate(prompts, params)
        done += len(prompts)
        if done >= next_print or done >= args.requests:
            now = rss_mb()
            marks.append(now)
            print(f"{done:8d} {now:9.1f} {now - start:+8.1f} {time.perf_counter() - t0:6.0f}", flush=True)
            next_print = done + args.every
    half = marks[len(marks) // 2]
    print(f"growth over the second half of the run: {marks[-1] - half:+.1f} MiB (whole run {marks[-1] - start:+.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
