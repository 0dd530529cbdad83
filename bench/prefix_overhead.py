"""What prefix caching costs the scheduler when nothing hits: the engine loop with a null executor.

    python -m bench.prefix_overhead --workload uniform --repeat 7   # or: conveyor bench prefix-overhead

Drives the real `Scheduler` and `CacheManager` over bench.offline's workloads (distinct random
prompts: a 0% hit rate) with an executor that returns a token at once, so all that is timed is
scheduling: deciding, building batches, applying results, and with prefix caching on, hashing
every full block, looking prompts up and registering blocks. The two run in lockstep (a step of
each in turn) and it reports each one's best time per step; divide the difference by a real step's
time (bench.offline) to get the end-to-end share.
"""

from __future__ import annotations

import argparse
import gc
import time

from bench.offline import WORKLOADS, make_workload, prompt_ids
from common.config import ExecutorInfo, SchedulerConfig
from common.protocol import ExecutorOutput, SchedulerOutput
from common.sampling_params import SamplingParams
from executor.input_batch import PersistentBatch
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.request import Request
from scheduler.scheduler import Scheduler


class NullExecutor:
    """Keeps the executor's request state (as a real one does) and returns token 1 for every
    sampled row, without a model."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.info = ExecutorInfo("null", num_blocks, block_size, max_model_len, [0], 8192)
        self.state = PersistentBatch(block_size)

    def execute_model(self, output: SchedulerOutput) -> ExecutorOutput:
        batch = self.state.prepare(output)
        tokens = [1 if s else -1 for s in batch.sample]
        self.state.append_sampled(batch, tokens)
        return ExecutorOutput(tokens, [])

    def reset(self) -> None:
        self.state.clear()


def make_engine(prompts: list[list[int]], outs: list[int], caching: bool, args: argparse.Namespace) -> EngineCore:
    executor = NullExecutor(args.num_blocks, args.block_size, args.max_model_len)
    config = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, enable_prefix_caching=caching)
    sched = Scheduler(config, CacheManager(args.num_blocks, args.block_size), executor.info)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        sched.add_request(Request(str(i), list(p), SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)))
    return EngineCore(sched, InlineExecutor(executor))


def run_paired(prompts: list[list[int]], outs: list[int], args: argparse.Namespace) -> tuple[float, float, int, int]:
    """Both engines in lockstep, one step each in turn (which goes first alternates), so a shared
    machine's drifting speed hits both alike. Seconds off, seconds on, steps, hits (tokens)."""
    off = make_engine(prompts, outs, False, args)
    on = make_engine(prompts, outs, True, args)
    t_off = t_on = 0.0
    clock = time.perf_counter
    while off.has_work() or on.has_work():
        first_off = off.scheduler.num_steps % 2 == 0
        for core in (off, on) if first_off else (on, off):
            if core.has_work():
                t = clock()
                core.step()
                dt = clock() - t
                if core is off:
                    t_off += dt
                else:
                    t_on += dt
    assert off.scheduler.num_steps == on.scheduler.num_steps
    return t_off, t_on, on.scheduler.num_steps, on.scheduler.prefix_cache_hits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="conveyor bench prefix-overhead", description=__doc__)
    ap.add_argument("--workload", default="uniform", choices=WORKLOADS)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args(argv)
    work = make_workload(args.workload)
    prompts = prompt_ids(work, 8192, num_special=8)
    totals = []
    for _ in range(args.repeat):
        gc.collect()
        gc.disable()  # a collection would land on whichever step triggers it
        try:
            t_off, t_on, steps, hits = run_paired(prompts, work.output_lens, args)
        finally:
            gc.enable()
        totals.append((t_off, t_on))
        print(
            f"{args.workload}: off {t_off * 1e3:.1f} ms, on {t_on * 1e3:.1f} ms ({t_on / t_off - 1:+.1%}), "
            f"{steps} steps, {hits} tokens hit",
            flush=True,
        )
    t_off, t_on = min(t[0] for t in totals), min(t[1] for t in totals)
    ratios = sorted(t[1] / t[0] for t in totals)
    print(
        f"\n{args.workload}: scheduling per step, best of {args.repeat}: off {t_off / steps * 1e6:.1f} us, "
        f"on {t_on / steps * 1e6:.1f} us; prefix caching adds {(t_on - t_off) / steps * 1e6:.1f} us per step "
        f"(median pair {ratios[len(ratios) // 2] - 1:+.1%})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
