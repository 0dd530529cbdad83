"""How many long requests a fixed KV pool serves at once, with and without window-aware freeing.

    python -m bench.window_kv --num-requests 24 --max-tokens 128 --max-num-batched-tokens 1024 --num-blocks 300
    python -m bench.window_kv --executor null --prompt-len 8192 --max-model-len 8800 --num-blocks 1100 \
        --num-requests 160 --max-tokens 512 --max-num-batched-tokens 2048       # or: conveyor bench window-kv ...
    python -m bench.window_kv --arch gemma3 --window 128 ...                    # a hybrid checkpoint
    python -m bench.window_kv --executor null --pattern 5:1 ...                 # Gemma 3's layer mix

A Mistral checkpoint whose every layer has a sliding window far shorter than the prompts (a tiny
random one made here, `executor.make_model`), ``--num-requests`` prompts submitted together to one
engine with ``--num-blocks`` KV blocks, run twice in the same process: keeping every block (as a
full-attention model must) and freeing the blocks behind the window (`scheduler.cache_manager`).
It reports, per mode, the most requests running at once, the mean over steps, preemptions, steps
and wall time, and checks that both modes produced the same tokens.

``--executor null`` swaps the model for one that samples token 1 at once (the scheduler and its
block tables are the real ones): the schedule does not depend on token values here (``ignore_eos``),
so its concurrency equals the model's, and it reaches 8k-token prompts that a CPU computes slowly.

Hybrid models (some layers full attention: ``--arch gemma2``/``gemma3``/``gpt_oss``, or
``--pattern R:1`` for the null executor, R window layers per full one) run KV-cache groups
(`scheduler.kv_groups`): ``--num-blocks`` is then the budget in blocks of every layer, as the
executor's ``num_blocks`` means, and the pool holds that memory in blocks of one layer slot.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from bench.prefix_overhead import NullExecutor
from common.config import SchedulerConfig
from common.sampling_params import SamplingParams
from executor.input_batch import PersistentBatch
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.kv_groups import cache_manager_for
from scheduler.request import Request
from scheduler.scheduler import Scheduler


@dataclass(slots=True)
class Result:
    """One mode's run."""

    max_running: int
    mean_running: float
    preemptions: int
    steps: int
    seconds: float
    tokens: dict[str, list[int]]


def drive(core: EngineCore, sched: Scheduler, prompts: list[list[int]], max_tokens: int) -> Result:
    """Submit every prompt at once and step the engine until all are done."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(Request(str(i), list(p), params))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    most = total = steps = 0
    start = time.perf_counter()
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
        running = len(sched.running)
        most, total, steps = max(most, running), total + running, steps + 1
    seconds = time.perf_counter() - start
    sched.cache.check_invariants()
    return Result(most, total / max(steps, 1), sched.num_preemptions, steps, seconds, tokens)


def run_mode(free: bool, prompts: list[list[int]], args: argparse.Namespace, model: str | None) -> Result:
    config = SchedulerConfig(
        args.max_num_batched_tokens, args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching, free_window_blocks=free
    )
    if model is None:
        ratio = None if args.pattern == "all" else int(args.pattern.split(":")[0])
        groups = 1 if ratio is None else ratio + 1  # one full group, R window groups, one layer slot
        executor: Any = NullExecutor(args.num_blocks * groups, args.block_size, args.max_model_len)
        if ratio is None:
            executor.info.sliding_window = args.window
        else:
            executor.info.kv_group_windows = [0] + [args.window] * ratio
            executor.state = PersistentBatch(args.block_size, None, groups)
        sched = Scheduler(config, cache_manager_for(executor.info, config), executor.info)
        return drive(EngineCore(sched, InlineExecutor(executor)), sched, prompts, args.max_tokens)
    from gateway.llm import LLM

    llm = LLM(
        model,
        device="cpu",
        dtype="float32",
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        free_window_blocks=free,
    )
    try:
        info = llm.executor.info
        assert info.sliding_window == args.window or args.window in info.kv_group_windows
        return drive(llm.engine_core, llm.scheduler, prompts, args.max_tokens)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--executor", choices=("model", "null"), default="model")
    ap.add_argument("--arch", choices=("mistral", "gemma2", "gemma3"), default="mistral", help="the checkpoint (model executor)")
    ap.add_argument("--pattern", default="all", help="null executor: 'all' layers windowed, or 'R:1' window to full layers")
    ap.add_argument("--window", type=int, default=128, help="the checkpoint's sliding window (its window layers)")
    ap.add_argument("--prompt-len", type=int, default=1900)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=480, help="the fixed KV budget, in blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="off, a block leaves the window at once; on, only once registered (one step later with async scheduling)",
    )
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if args.executor == "model":
            from executor.make_model import make_model

            model = str(make_model(args.arch, "tiny", args.seed, tmp, sliding_window=args.window))
        results = {free: run_mode(free, prompts, args, model) for free in (False, True)}
    print(
        f"{args.executor} executor ({args.arch if args.executor == 'model' else 'layers ' + args.pattern}): "
        f"{args.num_requests} requests of {args.prompt_len} prompt + {args.max_tokens} output "
        f"tokens, window {args.window}, {args.num_blocks} blocks of {args.block_size} "
        f"({args.num_blocks * args.block_size} tokens), chunk {args.max_num_batched_tokens}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}"
    )
    print(f"{'mode':<22}{'max running':>12}{'mean running':>14}{'preemptions':>13}{'steps':>8}{'seconds':>9}")
    for free, r in results.items():
        mode = "free window blocks" if free else "keep every block"
        print(f"{mode:<22}{r.max_running:>12}{r.mean_running:>14.1f}{r.preemptions:>13}{r.steps:>8}{r.seconds:>9.1f}")
    same = results[False].tokens == results[True].tokens
    print(f"same tokens in both modes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
