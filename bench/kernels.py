"""Triton kernel timings on a GPU, each against a ceiling measured in the same run.

    python -m bench.kernels [--json PATH]

- decode: paged attention for 64 sequences x 4k context (Hq 32 / Hkv 8, head 128, bf16, block
  16); achieved GB/s of K/V bytes read, against a device-to-device copy's GB/s (read + write).
- prefill: causal attention over whole prompts on the same heads, TFLOP/s against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same shapes.

Timing: CUDA events around ten calls back to back (launch latency hidden, as in a forward pass),
warm-up first, median of the repeats.
``--smoke`` runs the same code on the CPU under Triton's interpreter, on shapes small enough for a
test (fp32, since the interpreter gets bf16 wrong): it checks the script, its answers and its JSON,
never the speed (bench/device_check.sh's CPU_SMOKE and tests/test_device_check.py use it).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.attention_metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class Shapes:
    """What one run measures: the GPU's real shapes, or a CPU smoke run's small ones."""

    device: str
    dtype: torch.dtype
    copy_bytes: int
    decode_seqs: int
    decode_ctx: int
    prefill_seqs: int
    prefill_len: int
    heads: int
    kv_heads: int
    head_size: int
    block_size: int = 16
    warmup: int = 5
    iters: int = 10
    calls: int = 10  # back to back within one timing, so launch latency overlaps the kernels as in a forward


GPU = Shapes("cuda", torch.bfloat16, 2 << 30, 64, 4096, 4, 4096, 32, 8, 128)
# Head size 16 and contexts of a few blocks: tl.dot's smallest tile, and seconds under the interpreter.
SMOKE = Shapes("cpu", torch.float32, 1 << 20, 3, 80, 1, 40, 4, 2, 16, warmup=1, iters=2, calls=1)


def time_ms(fn: Callable[[], object], shapes: Shapes) -> float:
    """Milliseconds a call of ``fn``: the median over ``shapes.iters`` timings of ``shapes.calls``
    calls each (CUDA events on a GPU, else the wall clock)."""
    for _ in range(shapes.warmup):
        fn()
    cuda = shapes.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(shapes.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(shapes.calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / shapes.calls)
        else:
            t0 = time.perf_counter()
            for _ in range(shapes.calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / shapes.calls)
    return statistics.median(times)


def copy_gbps(shapes: Shapes) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=shapes.device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), shapes)
    return 2 * shapes.copy_bytes / ms / 1e6


def paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    dev: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and a paged cache whose blocks are scattered (a shuffled pool, like a busy engine)."""
    nblk = [(s + block_size - 1) // block_size for s in seq_lens]
    total = sum(nblk)
    perm = torch.randperm(total, device=dev).to(torch.int32)
    tables = torch.zeros((len(seq_lens), max(nblk)), dtype=torch.int32, device=dev)
    cursor = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[cursor : cursor + n]
        cursor += n
    shape = (total, block_size, kv_heads, head_size)
    k_cache = torch.randn(shape, dtype=dtype, device=dev)
    v_cache = torch.randn(shape, dtype=dtype, device=dev)
    num_tokens = sum(query_lens)
    q = torch.randn((num_tokens, heads, head_size), dtype=dtype, device=dev)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
    )
    return q, k_cache, v_cache, meta


def bench_decode(s: Shapes) -> dict[str, float]:
    """GB/s of K/V read by each decode path (dispatch, 2D, split-KV 2/4/8)."""
    from executor.kernels import dispatch_attention
    from executor.kernels.decode_split import decode_split
    from executor.kernels.paged_attention import paged_attention_2d

    seqs, ctx = s.decode_seqs, s.decode_ctx
    q, kc, vc, meta = paged_batch([ctx] * seqs, [1] * seqs, s.heads, s.kv_heads, s.head_size, s.block_size, s.dtype, s.device)
    scale = s.head_size**-0.5
    kv_bytes = 2 * seqs * ctx * s.kv_heads * s.head_size * kc.element_size()
    ref = paged_attention_2d(q, kc, vc, meta, scale)
    variants: dict[str, Callable[[], object]] = {
        "dispatch": lambda: dispatch_attention(q, kc, vc, meta, scale),
        "2d": lambda: paged_attention_2d(q, kc, vc, meta, scale),
    }
    for n in (2, 4, 8):
        variants[f"split{n}"] = functools.partial(decode_split, q, kc, vc, meta, scale, n)
    result: dict[str, float] = {}
    for name, fn in variants.items():
        torch.testing.assert_close(fn(), ref, atol=1.5e-2, rtol=1e-2)  # same answer on every path
        result[name] = kv_bytes / time_ms(fn, s) / 1e6
    return result


def bench_prefill(s: Shapes) -> dict[str, float]:
    """TFLOP/s of causal prefill: the paged kernel and SDPA on the same shapes."""
    from executor.kernels.paged_attention import paged_attention_2d

    seqs, length, heads, kv_heads, head_size = s.prefill_seqs, s.prefill_len, s.heads, s.kv_heads, s.head_size
    q, kc, vc, meta = paged_batch([length] * seqs, [length] * seqs, heads, kv_heads, head_size, s.block_size, s.dtype, s.device)
    scale = head_size**-0.5
    # SDPA inputs: the same K/V, gathered into contiguous [B, H, L, D] once (untimed).
    k = kc[meta.block_tables.long()].reshape(seqs, -1, kv_heads, head_size)[:, :length]
    v = vc[meta.block_tables.long()].reshape(seqs, -1, kv_heads, head_size)[:, :length]
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q.view(seqs, length, heads, head_size), k, v))
    flops = 4 * seqs * heads * head_size * length * (length + 1) / 2  # QK^T and PV, causal half

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

    ours = paged_attention_2d(q, kc, vc, meta, scale)
    want = sdpa().transpose(1, 2).reshape_as(ours)
    torch.testing.assert_close(ours, want, atol=1.5e-2, rtol=1e-2)
    return {
        "triton": flops / time_ms(lambda: paged_attention_2d(q, kc, vc, meta, scale), s) / 1e9,
        "sdpa": flops / time_ms(sdpa, s) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU (Triton's interpreter): checks, not timings")
    args = ap.parse_args(argv)
    shapes = SMOKE if args.smoke else GPU
    if not args.smoke and not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device (or --smoke)")
        return 2
    copy = copy_gbps(shapes)
    decode = bench_decode(shapes)
    prefill = bench_prefill(shapes)
    best_decode = max(decode.values())
    name = torch.cuda.get_device_name() if shapes.device == "cuda" else "cpu (smoke: the numbers mean nothing)"
    print(f"device {name}  copy {copy:.0f} GB/s (read+write)")
    decode_shape, prefill_shape = f"{shapes.decode_seqs}x{shapes.decode_ctx}", f"{shapes.prefill_seqs}x{shapes.prefill_len}"
    print("| kernel | variant | achieved | ceiling | share | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant, gbps in decode.items():
        print(f"| decode {decode_shape} | {variant} | {gbps:.0f} GB/s | {copy:.0f} GB/s | {gbps / copy:.0%} | >= 70% |")
    print(
        f"| prefill {prefill_shape} | triton | {prefill['triton']:.0f} TFLOP/s | "
        f"{prefill['sdpa']:.0f} TFLOP/s (SDPA) | {prefill['triton'] / prefill['sdpa']:.0%} | "
        f">= 50% |"
    )
    summary = {
        "device": name,
        "decode_shape": decode_shape,
        "prefill_shape": prefill_shape,
        "copy_gbps": copy,
        "decode_gbps": decode,
        "decode_share_of_copy": best_decode / copy,
        "decode_dispatch_share_of_copy": decode["dispatch"] / copy,
        "prefill_tflops": prefill,
        "prefill_share_of_sdpa": prefill["triton"] / prefill["sdpa"],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
