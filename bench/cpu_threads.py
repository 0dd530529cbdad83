"""The engine and transformers on an idle CPU and with busy-loop processes on the same cores.

    python -m bench.cpu_threads                       # small llama, uniform 64 x (32 in, 32 out)
    python -m bench.cpu_threads --hogs 0 1 2 --repeat 2

Every run is a fresh process, because libgomp reads its wait policy (``GOMP_SPINCOUNT``,
``OMP_WAIT_POLICY``) once, when torch loads it. Variants: transformers ``generate`` and the engine
with libgomp's default spin, both as a user gets them (no variable set), and the engine with
``GOMP_SPINCOUNT`` = `executor.threads.DEFAULT_GOMP_SPINCOUNT` (what the executor service sets).
For each number of ``while True: pass`` processes ("hogs") started beside them, prints output
tokens/s, the run's CPU seconds, and the share of the CPUs that other processes (hogs included)
used during it. See docs/performance.md, "CPU threads".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from executor.threads import DEFAULT_GOMP_SPINCOUNT, WAIT_POLICY_VARS

_HZ = os.sysconf("SC_CLK_TCK")
VARIANTS = {
    "transformers": ("hf", {}),
    "engine, libgomp default": ("engine", {}),
    f"engine, GOMP_SPINCOUNT={DEFAULT_GOMP_SPINCOUNT}": ("engine", {"GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}),
}


def _busy_cpu_seconds() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / _HZ  # all but idle and iowait


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(which: str, model: str, limit: int, output_len: int) -> dict:
    """One timed run in this process (called in a child): warm-up, then the whole workload."""
    import torch

    from bench.offline import make_workload, prompt_ids, run_engine, run_hf

    cfg = json.loads((Path(model) / "config.json").read_text())
    work = make_workload("uniform", limit)
    outs = [output_len] * len(work.output_lens)
    prompts = prompt_ids(work, cfg["vocab_size"], num_special=8)
    if which == "engine":
        from gateway.llm import LLM

        llm = LLM(model, dtype="float32", device="cpu", max_num_batched_tokens=1024, max_num_seqs=256)
        run = run_engine(llm, prompts, outs)
        elapsed, produced = run.elapsed, run.produced
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        elapsed, produced = run_hf(hf, prompts, outs, 64, "cpu")
    return {"tps": produced / elapsed, "elapsed": elapsed, "threads": torch.get_num_threads()}


def measure(which: str, extra_env: dict[str, str], args: argparse.Namespace) -> dict:
    """Run one variant in a child process; add its CPU seconds and the others' share of the CPUs."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY_VARS}
    env.update(extra_env)
    cmd = [
        sys.executable,
        "-m",
        "bench.cpu_threads",
        "--child",
        which,
        "--model",
        args.model,
        "--limit",
        str(args.limit),
        "--output-len",
        str(args.output_len),
    ]
    c0, b0, t0 = _children_cpu_seconds(), _busy_cpu_seconds(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    c1, b1, t1 = _children_cpu_seconds(), _busy_cpu_seconds(), time.perf_counter()
    if proc.returncode != 0:
        raise RuntimeError(f"{which} run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["cpu"] = c1 - c0
    result["others"] = max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0) / (os.cpu_count() or 1)
    return result


def main(argv: list[str] | None = None) -> int:
    """Alternate the variants with 0, 1, 2 (``--hogs``) busy loops beside them; print a table."""
    from executor.make_model import cached_model

    ap = argparse.ArgumentParser(prog="python -m bench.cpu_threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the cached `small` llama)")
    ap.add_argument("--limit", type=int, default=64, help="requests of the uniform workload (32 prompt tokens each)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 1, 2], help="busy-loop processes per round")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", choices=["engine", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or str(cached_model("llama", "small"))
    if args.child:
        print(json.dumps(run_one(args.child, args.model, args.limit, args.output_len)), flush=True)
        return 0
    rows: list[tuple[int, int, str, dict]] = []
    for rep in range(args.repeat):
        for hogs in args.hogs:
            names = list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
            try:
                for name in names:
                    which, extra = VARIANTS[name]
                    r = measure(which, extra, args)
                    rows.append((rep, hogs, name, r))
                    print(
                        f"round {rep} hogs {hogs} {name}: {r['tps']:.1f} tok/s, {r['cpu']:.1f} s CPU, "
                        f"others {r['others'] * 100:.0f}% of the CPUs",
                        flush=True,
                    )
            finally:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait()
    print("\n| round | hogs | variant | tok/s | CPU s | others' CPU share | tok/s / same variant with 0 hogs |")
    print("|---|---|---|---|---|---|---|")
    idle = {(rep, name): r["tps"] for rep, hogs, name, r in rows if hogs == 0}
    for rep, hogs, name, r in rows:
        base = idle.get((rep, name))
        kept = f"{r['tps'] / base:.2f}" if base else "-"
        print(f"| {rep} | {hogs} | {name} | {r['tps']:.1f} | {r['cpu']:.1f} | {r['others'] * 100:.0f}% | {kept} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
