"""Offline throughput: the engine against Hugging Face `generate` on the same checkpoint and work.

    python -m bench.offline --workload all           # or: conveyor bench offline --workload all

Prints output tokens/s of each, their ratio, the machine's measured `torch.mm` rate and the
engine's share of that roofline (2 x non-embedding params FLOPs per processed token).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.make_model import cached_model



@dataclass(slots=True)
class Workload:
    name: str
    prompt_lens: list[int]
    output_lens: list[int]


def make_workload(name: str, limit: int | None = None, seed: int = 0) -> Workload:
    """`uniform`: 64 x (32 in, 128 out); `mixed`: 200 x (16-512 in, 16-256 out), fixed seed."""
    rng = random.Random(seed)
    if name == "uniform":
        n, prompts, outputs = 64, [32] * 64, [128] * 64
    elif name == "mixed":
        n = 200
        prompts = [rng.randint(16, 512) for _ in range(n)]
        outputs = [rng.randint(16, 256) for _ in range(n)]
    else:
        raise ValueError(f"unknown workload {name!r}")
    n = min(n, limit or n)
    return Workload(name, prompts[:n], outputs[:n])


def prompt_ids(work: Workload, vocab_size: int, num_special: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(num_special, vocab_size) for _ in range(n)] for n in work.prompt_lens]


def mm_gflops(device: str, dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """The machine's matmul rate in this run: the roofline everything is quoted against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def run_engine(llm, prompts: list[list[int]], outs: list[int]) -> tuple[float, int]:
    from common.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(r.token_ids) for r in results)
    assert produced == sum(outs), (produced, sum(outs))
    return elapsed, produced


def run_hf(hf, prompts: list[list[int]], outs: list[int], batch_size: int, device: str) -> tuple[float, int]:
    """Batched `generate` with left padding, in arrival order, as a user would run it."""
    pad = hf.generation_config.pad_token_id or 0
    hf.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4, do_sample=False)
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, chunk_out = prompts[i : i + batch_size], outs[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        new = max(chunk_out)  # one length per call: every row runs to the longest
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, sum(outs)  # only the tokens each request asked for count


def non_embedding_params(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    lm_head = h * cfg["vocab_size"]  # computed once per sampled token, but counted per token
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + lm_head


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one table row per workload."""
    ap = argparse.ArgumentParser(prog="conveyor bench offline", description=__doc__)
    ap.add_argument("--model", default=None, help="HF directory (default: the cached `small` llama)")
    ap.add_argument("--workload", default="all", choices=["uniform", "mixed", "all"])
    ap.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="alternate engine and transformers runs this often; report each one's best")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = args.model or str(cached_model("llama", "small"))
    dtype = getattr(torch, args.dtype)
    cfg = json.loads((Path(model) / "config.json").read_text())
    engine_kw = dict(dtype=args.dtype, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs)
    roof = mm_gflops(args.device, dtype)
    flops_per_token = 2 * non_embedding_params(model)
    print(f"model={model} device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"torch.mm={roof:.1f} GFLOP/s")
    from scheduler.llm import LLM
    from transformers import AutoModelForCausalLM

    llm = LLM(model, **engine_kw)
    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    rows = []
    for name in (["uniform", "mixed"] if args.workload == "all" else [args.workload]):
        work = make_workload(name, args.limit)
        prompts = prompt_ids(work, cfg["vocab_size"], num_special=8)
        # The machine is shared and noisy: alternate the two and keep each one's best run.
        e_time = h_time = float("inf")
        for _ in range(args.repeat):
            t, e_tokens = run_engine(llm, prompts, work.output_lens)
            e_time = min(e_time, t)
            print(f"{name}: engine {e_tokens} tokens in {t:.1f}s", flush=True)
            if hf is not None:
                t, h_tokens = run_hf(hf, prompts, work.output_lens, args.hf_batch_size, args.device)
                h_time = min(h_time, t)
                print(f"{name}: transformers {h_tokens} tokens in {t:.1f}s", flush=True)
        processed = sum(work.prompt_lens) + sum(work.output_lens)
        share = flops_per_token * processed / e_time / 1e9 / roof
        h_tps = None if hf is None else sum(work.output_lens) / h_time
        rows.append((name, len(prompts), e_tokens / e_time, h_tps, share))
    print("\n| workload | requests | engine tok/s | transformers tok/s | ratio | engine share of mm roofline |")
    print("|---|---|---|---|---|---|")
    for name, n, e_tps, h_tps, share in rows:
        ratio = f"{e_tps / h_tps:.2f}x" if h_tps else "-"
        h = f"{h_tps:.1f}" if h_tps else "-"
        print(f"| {name} | {n} | {e_tps:.1f} | {h} | {ratio} | {share * 100:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
