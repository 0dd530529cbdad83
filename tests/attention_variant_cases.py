"""Paged attention with a sliding window, attention sinks and soft-capping against a plain torch
reference, one case per process: ``python -m tests.attention_variant_cases <case>...``.

Run by tests/test_family_kernels.py (under Triton's interpreter without a GPU) and by
bench/device_check.sh on a GPU (compiled, with bf16 and longer sequences). Imports no pytest.

The reference is written here from the definition in `executor.ops.Ops.paged_attention`, not
taken from either backend. Every key a window hides from all of a sequence's queries is NaN in the
cache, and blocks wholly before the window point at the NaN block 0 of the table (as a
window-aware KV manager frees them): a kernel that reads them instead of skipping them fails.
"""

from __future__ import annotations

import sys

import torch

from executor.kernels import dispatch_attention
from executor.kernels.decode_split import decode_split
from executor.kernels.kv_write import write_kv_ref
from executor.kernels.paged_attention import Variant, paged_attention_2d
from tests.kernel_cases import DEVICE, ON_GPU, PagedBatch, check, dtypes, make_batch


def attention_ref(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each query at position p over keys ``max(p - W + 1, 0) .. p`` of its sequence, in fp64:
    score = q.k * scale, then ``c * tanh(score / c)``, then the mask; a sink adds exp(sink) to the
    softmax denominator (its row max included) and no value."""
    q, k_cache, v_cache, meta = batch.q, batch.k_cache, batch.v_cache, batch.meta
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_size = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_list):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        # Only the keys some query of the sequence sees are read (the rest may be NaN).
        first = max(seq_len - q_len - sliding_window + 1, 0) if sliding_window else 0
        k_pos = torch.arange(first, seq_len, device=q.device)
        slots = meta.block_tables[i].long()[k_pos // block_size] * block_size + k_pos % block_size
        k = k_cache.view(-1, num_kv_heads, head_size)[slots].double().repeat_interleave(group, dim=1)
        v = v_cache.view(-1, num_kv_heads, head_size)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q[q_lo:q_hi].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(num_heads, q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., : k_pos.numel()]
        out[q_lo:q_hi] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out


def windowed_batch(
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    window: int,
    seed: int,
) -> PagedBatch:
    """A batch whose new tokens are written and whose keys outside every window are poisoned."""
    batch = make_batch(specs, heads, kv_heads, head_size, 16, dtype, seed=seed)
    meta = batch.meta
    write_kv_ref(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, meta.slot_mapping)
    block_size, rows = batch.k_cache.shape[1], batch.k_cache.shape[2:]
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.query_lens_list)):
        first = max(seq_len - q_len - window + 1, 0)
        pos = torch.arange(first, device=DEVICE)
        slots = meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        batch.k_cache.view(-1, *rows)[slots] = float("nan")
        batch.v_cache.view(-1, *rows)[slots] = float("nan")
        meta.block_tables[i, : first // block_size] = 0  # "freed": block 0 is all NaN
    return batch


def sinks_for(heads: int, seed: int) -> torch.Tensor:
    """Sink logits around the scores' scale, some large enough to dominate a row."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, generator=gen) * 2.0).to(DEVICE)


LONG = 1500 if ON_GPU else 200
MIXED = [(LONG, LONG), (300, 45), (1, 1), (257, 1), (77, 1), (130, 17), (33, 33)]
DECODE = [(1, 1), (17, 1), (LONG, 1), (333, 1), (64, 1)]


def run_variant(
    batch: PagedBatch,
    dtype: torch.dtype,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    splits: list[int],
) -> None:
    """The 2D kernel, split-KV decode (decode batches) and the dispatcher against the reference."""
    scale = batch.q.shape[-1] ** -0.5
    want = attention_ref(batch, scale, window, sinks, softcap)
    variant = Variant.of(batch.q, window, sinks, softcap)
    name = f"window={window} sinks={sinks is not None} softcap={softcap}"
    out = torch.full_like(batch.q, float("nan"))
    paged_attention_2d(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=out, variant=variant)
    check(f"2d {name}", out, want, dtype)
    for n in splits:
        out = torch.full_like(batch.q, float("nan"))
        decode_split(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, n, out=out, variant=variant)
        check(f"decode_split[{n}] {name}", out, want, dtype)
    got = dispatch_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, sliding_window=window, sinks=sinks, softcap=softcap
    )
    check(f"dispatch {name}", got, want, dtype)


def check_arguments() -> None:
    """Arguments outside their definitions are refused, not run."""
    q = torch.zeros((2, 8, 64), device=DEVICE)
    for window, sinks, softcap in ((0, None, None), (None, torch.zeros(7), None), (None, None, 0.0)):
        try:
            Variant.of(q, window, sinks, softcap)
        except ValueError:
            continue
        raise AssertionError(f"accepted window={window} sinks={sinks} softcap={softcap}")
    assert Variant.of(q, 4096, None, None).visible_keys(10_000) == 4096  # split-KV sizes by the window
    assert Variant.of(q, None, None, None).visible_keys(10_000) == 10_000


def case_window_mixed() -> None:
    """Windows of 1 key, one crossing block boundaries (40 over blocks of 16), one exactly a block,
    and one past every context, over mixed prefill/decode batches with GQA 8/2 and 4/4."""
    check_arguments()
    for dtype in dtypes(torch.float32):
        for window in (1, 16, 40, 5000):
            batch = windowed_batch(MIXED, 8, 2, 64, dtype, window, seed=window)
            run_variant(batch, dtype, window, None, None, [])
    for dtype in dtypes(torch.float16):
        batch = windowed_batch(MIXED, 4, 4, 80, dtype, 40, seed=11)
        run_variant(batch, dtype, 40, None, None, [])


def case_sinks_softcap_mixed() -> None:
    """Sinks alone, soft-capping alone (scores scaled up so the cap bites), and both with a window."""
    for dtype in dtypes(torch.float32):
        batch = windowed_batch(MIXED, 8, 2, 64, dtype, 10**6, seed=21)
        run_variant(batch, dtype, None, sinks_for(8, 1), None, [])
        batch.q.mul_(8.0)
        run_variant(batch, dtype, None, None, 5.0, [])
        batch = windowed_batch(MIXED, 8, 2, 64, dtype, 24, seed=22)
        run_variant(batch, dtype, 24, sinks_for(8, 2), 20.0, [])
    for dtype in dtypes(torch.float16):
        batch = windowed_batch(MIXED, 5, 1, 64, dtype, 33, seed=23)
        run_variant(batch, dtype, 33, sinks_for(5, 3), 30.0, [])


def case_window_decode_split() -> None:
    """Split-KV decode: the window's keys cut in 1, 3 and 16 splits (empty ones included), the sink
    added by the first split only."""
    for dtype in dtypes(torch.float32):
        for window, sinks in ((40, None), (100, sinks_for(8, 4)), (5000, sinks_for(8, 5))):
            batch = windowed_batch(DECODE, 8, 2, 64, dtype, window, seed=30 + window)
            run_variant(batch, dtype, window, sinks, None, [1, 3, 16])
    for dtype in dtypes(torch.float16):
        batch = windowed_batch(DECODE, 4, 1, 128, dtype, 70, seed=39)
        run_variant(batch, dtype, 70, sinks_for(4, 6), 25.0, [1, 4])


CASES = {
    "window_mixed": case_window_mixed,
    "sinks_softcap_mixed": case_sinks_softcap_mixed,
    "window_decode_split": case_window_decode_split,
}


def main(argv: list[str]) -> int:
    for name in argv or list(CASES):
        CASES[name]()
        print(f"OK {name} on {DEVICE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
