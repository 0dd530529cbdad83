"""Triton kernel timings on a GPU, each against a ceiling measured in the same run.

    python -m bench.kernels [--json PATH]

- decode: paged attention for 64 sequences x 4k context (Hq 32 / Hkv 8, head 128, bf16, block
  16); achieved GB/s of K/V bytes read, against a device-to-device copy's GB/s (read + write).
- prefill: causal attention over whole prompts on the same heads, TFLOP/s against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same shapes.

Timing: CUDA events around each call, warm-up first, median of the repeats.
Also ``python -m bench.kernels --make-model DIR``: a ~0.5B-parameter random llama for bench.offline.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable

import torch

from executor.attention_metadata import AttentionMetadata


def time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and a paged cache whose blocks are scattered (a shuffled pool, like a busy engine)."""
    dev = "cuda"
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


def bench_decode(
    seqs: int = 64, ctx: int = 4096, heads: int = 32, kv_heads: int = 8, head_size: int = 128, block_size: int = 16
) -> dict[str, float]:
    """GB/s of K/V read by each decode path (dispatch, 2D, split-KV 2/4/8)."""
    from executor.kernels import dispatch_attention
    from executor.kernels.decode_split import decode_split
    from executor.kernels.paged_attention import paged_attention_2d

    dtype = torch.bfloat16
    q, kc, vc, meta = paged_batch([ctx] * seqs, [1] * seqs, heads, kv_heads, head_size, block_size, dtype)
    scale = head_size**-0.5
    kv_bytes = 2 * seqs * ctx * kv_heads * head_size * kc.element_size()
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
        result[name] = kv_bytes / time_ms(fn) / 1e6
    return result


def bench_prefill(
    seqs: int = 4, length: int = 4096, heads: int = 32, kv_heads: int = 8, head_size: int = 128, block_size: int = 16
) -> dict[str, float]:
    """TFLOP/s of causal prefill: the paged kernel and SDPA on the same shapes."""
    from executor.kernels.paged_attention import paged_attention_2d

    dtype = torch.bfloat16
    q, kc, vc, meta = paged_batch([length] * seqs, [length] * seqs, heads, kv_heads, head_size, block_size, dtype)
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
        "triton": flops / time_ms(lambda: paged_attention_2d(q, kc, vc, meta, scale)) / 1e9,
        "sdpa": flops / time_ms(sdpa) / 1e9,
    }


def make_half_b_model(out: str) -> str:
    """A ~0.5B-parameter random llama (hidden 1536, 20 layers, 12/4 heads of 128)."""
    from executor import make_model as mm

    # Not one of make_model's named sizes yet: register the geometry for this call.
    mm.GEOMETRY.setdefault(
        "bench_0.5b", dict(vocab=8192, hidden=1536, layers=20, heads=12, kv_heads=4, head_dim=128, inter=4096, max_pos=4096)
    )
    if "bench_0.5b" not in mm.SIZES:
        mm.SIZES = (*mm.SIZES, "bench_0.5b")
    return str(mm.make_model("llama", "bench_0.5b", 0, out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--make-model", default=None, metavar="DIR", help="only write the ~0.5B benchmark checkpoint into DIR")
    args = ap.parse_args(argv)
    if args.make_model:
        print(f"wrote {make_half_b_model(args.make_model)}")
        return 0
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device")
        return 2
    copy = copy_gbps()
    decode = bench_decode()
    prefill = bench_prefill()
    best_decode = max(decode.values())
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.0f} GB/s (read+write)")
    print("| kernel | variant | achieved | ceiling | share | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, gbps in decode.items():
        print(f"| decode 64x4k | {name} | {gbps:.0f} GB/s | {copy:.0f} GB/s | {gbps / copy:.0%} | >= 70% |")
    print(
        f"| prefill 4x4k | triton | {prefill['triton']:.0f} TFLOP/s | "
        f"{prefill['sdpa']:.0f} TFLOP/s (SDPA) | {prefill['triton'] / prefill['sdpa']:.0%} | "
        f">= 50% |"
    )
    summary = {
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
