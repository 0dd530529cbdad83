"""Per-token cost of structured outputs: constrained against unconstrained decoding, same run.

    OMP_NUM_THREADS=1 python -m bench.structured --model ~/.cache/conveyor/models/small-llama

One offline engine runs a batch of ``--batch`` requests (``--prompt-len`` random prompt tokens,
``--max-tokens`` output tokens each) repeatedly, alternating: unconstrained, then under each
constraint (a JSON schema, a regex). Each constraint keeps every request decoding to
``max_tokens`` (a JSON array of at least 1000 objects; a 4000-character regex), and the
unconstrained runs ignore EOS, so every run produces the same number of tokens. Sampling at
temperature 1 (seeded) walks the grammar through many states. Each configuration runs once
untimed first (the executor caches compiled grammars by spec, and llguidance builds lexer states
lazily). Reports the best (least disturbed) seconds per output token of each, each constraint's
overhead against unconstrained (best against best, and the median over repeats of its run against
the unconstrained run just before it), and per step the worker's mask time and how long sampling waited
for it (the part the forward pass did not hide).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from executor.threads import set_openmp_env_defaults

set_openmp_env_defaults()  # before torch loads OpenMP

from common.sampling_params import SamplingParams  # noqa: E402
from common.structured_outputs import StructuredOutputsParams  # noqa: E402
from executor.make_model import cached_model  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json={"type": "array", "items": ITEM, "minItems": 1000}),
    "regex": StructuredOutputsParams(regex=r"([a-z]+ [0-9]+, ){1000}"),
}


def _params(args: argparse.Namespace, spec: StructuredOutputsParams | None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=spec is None, structured_outputs=spec)
        for i in range(args.batch)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__)
    ap.add_argument("--model", default=None, help="HF directory (default: the cached `small` llama)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)

    from gateway.llm import LLM

    model = args.model or str(cached_model("llama", "small"))
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=max(256, args.batch))
    vocab = llm.executor.info.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]

    from executor.model_executor import ModelExecutor

    assert isinstance(llm.executor, ModelExecutor), "one rank: its executor runs in this process"
    stats = llm.executor.structured.stats

    def run(spec: StructuredOutputsParams | None) -> tuple[float, int, list[str], tuple[int, float, float]]:
        before = (stats.steps, stats.fill_s, stats.wait_s)
        start = time.perf_counter()
        outs = llm.generate(prompts, _params(args, spec))
        seconds = time.perf_counter() - start
        used = (stats.steps - before[0], stats.fill_s - before[1], stats.wait_s - before[2])
        return seconds, sum(len(o.token_ids) for o in outs), [o.text for o in outs], used

    compile_ms: dict[str, float] = {}
    configs: list[tuple[str, StructuredOutputsParams | None]] = [("unconstrained", None), *CONSTRAINTS.items()]
    for name, constraint in CONSTRAINTS.items():  # compile (and warm) once, outside the timing
        start = time.perf_counter()
        llm.generate(prompts[:1], [SamplingParams(max_tokens=2, structured_outputs=constraint)])
        compile_ms[name] = (time.perf_counter() - start) * 1e3
    for _, spec in configs:  # warm: llguidance builds its lexer states lazily
        run(spec)
    best: dict[str, float] = {}
    tokens: dict[str, int] = {}
    sample: dict[str, str] = {}
    masks: dict[str, dict[str, float]] = {}
    ratios: dict[str, list[float]] = {name: [] for name in CONSTRAINTS}
    for _ in range(args.repeats):
        this: dict[str, float] = {}
        for name, spec in configs:
            seconds, n, texts, (steps, fill_s, wait_s) = run(spec)
            this[name] = seconds / n
            if seconds / n < best.get(name, float("inf")):
                best[name] = seconds / n
                if steps:
                    masks[name] = {
                        "fill_ms_per_step": round(fill_s / steps * 1e3, 3),
                        "wait_ms_per_step": round(wait_s / steps * 1e3, 3),
                    }
            tokens[name], sample[name] = n, texts[0]
        for name in CONSTRAINTS:  # against the unconstrained run just before it: the least drift
            ratios[name].append(this[name] / this["unconstrained"])
    base = best["unconstrained"]
    result: dict[str, Any] = {
        "model": model,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "output_tokens_per_run": tokens,
        "ms_per_token": {k: round(v * 1e3, 4) for k, v in best.items()},
        "overhead_best_vs_best": {k: round(best[k] / base - 1, 4) for k in CONSTRAINTS},
        "overhead_median_of_paired_runs": {k: round(statistics.median(v) - 1, 4) for k, v in ratios.items()},
        "paired_ratios": {k: [round(r, 3) for r in v] for k, v in ratios.items()},
        "batch_mask_ms_per_step": masks,
        "first_request_ms_with_compile": {k: round(v, 1) for k, v in compile_ms.items()},
        "sample_json_output": sample["json"][:120],
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
