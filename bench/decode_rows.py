"""Few-row decode in process: the CPU decode kernel against the torch path, at 1, 8, ... rows.

    python -m bench.decode_rows                        # the cached `small` llama, rows 1 and 8
    python -m bench.decode_rows --rows 1 2 4 8 --repeat 3 --model DIR
    python -m bench.decode_rows --rows 1 --prompt-tokens 2000        # decoding at a long context

For each row count ``B``, an offline `LLM` decodes ``B`` requests (``--prompt-tokens`` each, 128
greedy tokens, EOS ignored; the prefill's time is measured apart and subtracted) with
``cpu_decode_kernel`` ``auto`` and ``off``, one after the other, each its best of ``--repeat``
timed runs after a warm-up. Prints ms per step and tokens/s per mode, the ratio auto/off, and
whether the two produced the same tokens. The stepping includes everything between steps in
process (scheduling, sampling, bookkeeping), not serving: `conveyor bench serve` measures the
served path (docs/performance.md, "Few-row decode on CPU").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from executor.threads import set_openmp_env_defaults

OUTPUT_TOKENS = 128


def run(model: str, mode: str, rows: int, repeat: int, prompt_tokens: int) -> tuple[float, list[list[int]]]:
    """Best seconds per decode step over ``repeat`` runs, and the tokens, of ``rows`` requests."""
    from common.sampling_params import SamplingParams
    from gateway.llm import LLM

    per_row = -(-(prompt_tokens + OUTPUT_TOKENS) // 16)
    llm = LLM(model, num_blocks=max(512, per_row * rows), cpu_decode_kernel=mode, max_num_batched_tokens=max(1024, prompt_tokens))
    if mode == "auto" and getattr(llm.executor, "cpu_decode", None) is None:
        raise SystemExit("the CPU decode kernel is off here (the executor's log says why)")
    prompts = [[(13 * i + 7 * b) % 4000 + 10 for i in range(prompt_tokens)] for b in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    best, tokens = float("inf"), []
    for _ in range(repeat):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(prompts, prefill)  # the prefill alone, subtracted: what is left is decoding
        first = time.perf_counter() - t
        llm.reset_prefix_cache()
        t = time.perf_counter()
        out = llm.generate(prompts, params)
        best = min(best, (time.perf_counter() - t - first) / (OUTPUT_TOKENS - 1))
        tokens = [o.token_ids for o in out]
    llm.shutdown()
    return best, tokens


def main(argv: list[str] | None = None) -> int:
    """Print, per row count, the decode step time with and without the kernel."""
    set_openmp_env_defaults()  # before torch loads (as the executor's entry points do)
    from executor.make_model import cached_model

    ap = argparse.ArgumentParser(prog="python -m bench.decode_rows", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the cached `small` llama)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    model = args.model or str(cached_model("llama", "small"))
    print(f"model {Path(model).name}: {args.prompt_tokens} prompt tokens, {OUTPUT_TOKENS} out, best of {args.repeat}")
    for rows in args.rows:
        step = {}
        tokens = {}
        for mode in ("auto", "off"):
            step[mode], tokens[mode] = run(model, mode, rows, args.repeat, args.prompt_tokens)
            print(f"rows {rows} {mode:4s}: {step[mode] * 1e3:7.2f} ms/step, {rows / step[mode]:7.1f} tok/s", flush=True)
        same = "same tokens" if tokens["auto"] == tokens["off"] else "TOKENS DIFFER"
        print(f"rows {rows}: kernel / torch speed {step['off'] / step['auto']:.2f}x ({same})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
