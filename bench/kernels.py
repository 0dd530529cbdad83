"""Triton kernel timings on a GPU, each against a ceiling measured in the same run.

    python -m bench.kernels [--json PATH]

- decode: paged attention for 64 sequences x 4k context (Hq 32 / Hkv 8, head 128, bf16, block
  16); achieved GB/s of K/V bytes read, against a device-to-device copy's GB/s (read + write).
- prefill: causal attention over whole prompts on the same heads, TFLOP/s against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same shapes.
- window decode: the decode batch with a sliding window and attention sinks (dispatch), against a
  torch path (gather the window's K/V, softmax with the sink column); max abs diff and times, and
  its time as a share of the full-context decode's (skipped tiles show as a small share).
- decode sweep: decode attention alone at batch 1, 8 and 64 with 4k and 32k contexts, eager
  (dispatch on the step's own lengths) and replayed from a CUDA graph captured as the engine
  captures it (`executor.cuda_graphs.GraphInputs`, its split-KV count picked at capture from a
  32k max context), and a graph held to the 2D kernel as the baseline; microseconds per call.
- fused MoE: the Triton kernel against the torch backend's ``fused_moe`` on a Qwen3-30B-A3B
  layer (128 experts, top-8, hidden 2048, intermediate 768) for several token counts; max abs
  diff, times, and the kernel's GB/s of the expert weights it touches.

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
    window: int
    moe: tuple[int, int, int, int]  # experts, top-k, hidden, intermediate
    moe_tokens: tuple[int, ...]
    sweep_batches: tuple[int, ...]
    sweep_contexts: tuple[int, ...]
    block_size: int = 16
    warmup: int = 5
    iters: int = 10
    calls: int = 10  # back to back within one timing, so launch latency overlaps the kernels as in a forward


GPU = Shapes(
    "cuda",
    torch.bfloat16,
    2 << 30,
    64,
    4096,
    4,
    4096,
    32,
    8,
    128,
    1024,
    (128, 8, 2048, 768),
    (1, 16, 256, 2048),
    (1, 8, 64),
    (4096, 32768),
)
# Head size 16 and contexts of a few blocks: tl.dot's smallest tile, and seconds under the interpreter.
SMOKE = Shapes(
    "cpu",
    torch.float32,
    1 << 20,
    3,
    80,
    1,
    40,
    4,
    2,
    16,
    24,
    (4, 2, 32, 48),
    (1, 5),
    (1, 2),
    (40, 80),
    warmup=1,
    iters=2,
    calls=1,
)


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


def window_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of sequences of one length over their last ``window`` keys, with sinks,
    in plain torch: gather the window's K/V, scores in fp32, a sink column, softmax, drop it."""
    seqs, heads, head_size = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    seq_len = meta.seq_lens_list[0]
    pos = torch.arange(max(seq_len - window, 0), seq_len, device=q.device)
    slots = meta.block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, W]
    k = k_cache.view(-1, kv_heads, head_size)[slots].float().repeat_interleave(heads // kv_heads, dim=2)
    v = v_cache.view(-1, kv_heads, head_size)[slots].float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bhd,bwhd->bhw", q.float(), k) * scale
    scores = torch.cat([scores, sinks.float()[None, :, None].expand(seqs, heads, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]
    return torch.einsum("bhw,bwhd->bhd", probs, v).to(q.dtype)


def bench_window_decode(s: Shapes) -> dict[str, float]:
    """Sliding-window decode with sinks: the dispatcher against the torch path, and against the
    same batch's full-context decode (the tiles before the window are skipped, not masked)."""
    from executor.kernels import dispatch_attention

    seqs, ctx = s.decode_seqs, s.decode_ctx
    q, kc, vc, meta = paged_batch([ctx] * seqs, [1] * seqs, s.heads, s.kv_heads, s.head_size, s.block_size, s.dtype, s.device)
    scale = s.head_size**-0.5
    sinks = torch.randn(s.heads, device=s.device)

    def ours() -> torch.Tensor:
        return dispatch_attention(q, kc, vc, meta, scale, sliding_window=s.window, sinks=sinks)

    def reference() -> torch.Tensor:
        return window_attention_torch(q, kc, vc, meta, scale, s.window, sinks)

    got, want = ours(), reference()
    torch.testing.assert_close(got, want, atol=1.5e-2, rtol=1e-2)
    diff = (got.float() - want.float()).abs().max().item()
    triton_ms, torch_ms = time_ms(ours, s), time_ms(reference, s)
    full_ms = time_ms(lambda: dispatch_attention(q, kc, vc, meta, scale), s)
    return {"max_abs_diff": diff, "triton_ms": triton_ms, "torch_ms": torch_ms, "full_context_ms": full_ms}


def _sweep_point(s: Shapes, b: int, ctx: int, max_ctx: int) -> dict[str, float]:
    """One batch x context of `bench_decode_sweep`."""
    from executor.cuda_graphs import GraphInputs
    from executor.kernels import _num_sms, dispatch_attention
    from executor.kernels.decode_split import choose_num_splits

    cuda = s.device == "cuda"
    scale = s.head_size**-0.5
    q, kc, vc, meta = paged_batch([ctx] * b, [1] * b, s.heads, s.kv_heads, s.head_size, s.block_size, s.dtype, s.device)
    ref = dispatch_attention(q, kc, vc, meta, scale)
    row: dict[str, float] = {"eager_us": 1e3 * time_ms(lambda: dispatch_attention(q, kc, vc, meta, scale), s)}
    for name, longest in (("graph", max_ctx), ("graph_2d", None)):
        inputs = GraphInputs(b, meta.block_tables.shape[1], q.device, max_seq_len=longest)
        ids = torch.zeros(b, dtype=torch.int64, device=q.device)
        gmeta = inputs.load(ids, ids, meta, b)

        def call(gmeta: AttentionMetadata = gmeta) -> torch.Tensor:
            return dispatch_attention(q, kc, vc, gmeta, scale)

        if cuda:
            call()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, ref, atol=1.5e-2, rtol=1e-2)
            row[f"{name}_us"] = 1e3 * time_ms(graph.replay, s)
        else:
            torch.testing.assert_close(call(), ref, atol=1e-4, rtol=1e-4)
            row[f"{name}_us"] = 1e3 * time_ms(call, s)
    row["graph_splits"] = choose_num_splits(b, s.kv_heads, max_ctx, _num_sms(q.device))
    return row


def bench_decode_sweep(s: Shapes) -> dict[str, dict[str, float]]:
    """Per batch x context: microseconds of one decode attention call, eager and from a graph
    (with the split-KV count a capture at the largest context picks, and held to 2D), and that
    split count. Without CUDA the "graph" calls run uncaptured on the same metadata."""
    result: dict[str, dict[str, float]] = {}
    for ctx in s.sweep_contexts:
        for b in s.sweep_batches:
            result[f"b{b}_ctx{ctx}"] = _sweep_point(s, b, ctx, max(s.sweep_contexts))
            if s.device == "cuda":
                torch.cuda.empty_cache()  # the 32k caches of batch 64 are 8.6 GB each
    return result


def bench_fused_moe(s: Shapes) -> dict[str, dict[str, float]]:
    """Per token count: the fused-MoE kernel and the torch backend's fused_moe on the same layer."""
    from executor import ops_torch
    from executor.kernels.fused_moe import fused_moe

    experts, top_k, hidden, inter = s.moe
    gen = torch.Generator(device=s.device).manual_seed(0)
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen, device=s.device).mul_(hidden**-0.5).to(s.dtype)
    w2 = torch.randn((experts, hidden, inter), generator=gen, device=s.device).mul_(inter**-0.5).to(s.dtype)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    result: dict[str, dict[str, float]] = {}
    for tokens in s.moe_tokens:
        x = torch.randn((tokens, hidden), generator=gen, device=s.device).to(s.dtype)
        logits = torch.randn((tokens, experts), generator=gen, device=s.device)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)

        def ours(x: torch.Tensor = x, weights: torch.Tensor = weights, ids: torch.Tensor = ids) -> torch.Tensor:
            return fused_moe(x, w13, w2, weights, ids)

        def reference(x: torch.Tensor = x, weights: torch.Tensor = weights, ids: torch.Tensor = ids) -> torch.Tensor:
            return ops_torch.fused_moe(x, w13, w2, weights, ids)

        got, want = ours(), reference()
        # Both round the intermediate to the model dtype, at different points: bf16's tolerance, twice.
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
        diff = (got.float() - want.float()).abs().max().item()
        triton_ms, torch_ms = time_ms(ours, s), time_ms(reference, s)
        touched = int(torch.unique(ids).numel())
        result[str(tokens)] = {
            "max_abs_diff": diff,
            "triton_ms": triton_ms,
            "torch_ms": torch_ms,
            "weight_gbps": touched * expert_bytes / triton_ms / 1e6,
        }
    return result


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
    window = bench_window_decode(shapes)
    moe = bench_fused_moe(shapes)
    sweep = bench_decode_sweep(shapes)
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
    print(
        f"| window decode {decode_shape} w={shapes.window}+sinks | dispatch | {window['triton_ms']:.3f} ms | "
        f"torch {window['torch_ms']:.3f} ms; full context {window['full_context_ms']:.3f} ms | "
        f"{window['triton_ms'] / window['full_context_ms']:.0%} of full | max abs diff {window['max_abs_diff']:.2e} |"
    )
    moe_shape = "E{}k{} {}x{}".format(*shapes.moe)
    for tokens, r in moe.items():
        print(
            f"| fused_moe {moe_shape} T={tokens} | triton | {r['triton_ms']:.3f} ms ({r['weight_gbps']:.0f} GB/s of weights) | "
            f"torch {r['torch_ms']:.3f} ms | {r['torch_ms'] / r['triton_ms']:.1f}x | max abs diff {r['max_abs_diff']:.2e} |"
        )
    for key, r in sweep.items():
        print(
            f"| decode sweep {key} | eager {r['eager_us']:.1f} us | graph ({r['graph_splits']:.0f} splits) "
            f"{r['graph_us']:.1f} us; graph 2D {r['graph_2d_us']:.1f} us | {r['graph_2d_us'] / r['graph_us']:.2f}x | |"
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
        "window_decode": dict(window, window=shapes.window),
        "moe_shape": moe_shape,
        "fused_moe": moe,
        "decode_sweep": sweep,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
