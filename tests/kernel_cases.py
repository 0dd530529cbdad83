"""Kernel-vs-reference cases, one per process: ``python -m tests.kernel_cases <case> [device]``.

Run in a subprocess by tests/test_kernels.py because Triton's interpreter must be chosen before
any kernel is defined, and an out-of-bounds access under the interpreter can kill the process.
On CUDA (no interpreter) the same cases add bf16 and longer sequences.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from executor.attention_metadata import AttentionMetadata  # noqa: E402
from executor.kernels.activation import (  # noqa: E402
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from executor.kernels.decode_split import decode_split  # noqa: E402
from executor.kernels.kv_write import write_kv, write_kv_ref  # noqa: E402
from executor.kernels.paged_attention import paged_attention_2d, paged_attention_ref  # noqa: E402
from executor.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from executor.kernels.rotary import rotary, rotary_ref  # noqa: E402

ON_GPU = DEVICE == "cuda"
# The interpreter computes bf16 wrongly, so bf16 runs only on the GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {
    torch.float32: dict(atol=2e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1e-2),
}
INT32_LIMIT = 2**31


def dtypes(cpu_choice: torch.dtype) -> list[torch.dtype]:
    """Every dtype on the GPU; one per case under the (slow) interpreter, alternated over cases."""
    return DTYPES if ON_GPU else [cpu_choice]


def check(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element finite (no NaN poisoning) and close to the reference."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    bad = ~torch.isfinite(got)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite outputs (unwritten or NaN leak)"
    torch.testing.assert_close(got.float(), want.float(), msg=lambda m: f"{name}: {m}", **TOL[dtype])


@dataclass(slots=True)
class PagedBatch:
    """A mixed batch over a NaN-poisoned paged cache, new tokens not yet written."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    used_blocks: torch.Tensor


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    huge_pool: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """``specs`` = [(seq_len, query_len)]. Blocks are scattered over the pool; with ``huge_pool``
    they all sit past element 2^31 of a cache that is only ever touched there (torch.empty maps
    the rest lazily, so a 4 GiB pool costs a few MiB of real memory on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    per_block = block_size * num_kv_heads * head_size
    blocks_needed = [(s + block_size - 1) // block_size for s, _ in specs]
    total = sum(blocks_needed)
    if huge_pool:
        first = INT32_LIMIT // per_block + 1
        num_blocks = first + total + 3
        ids = first + torch.randperm(total + 3, generator=gen)[:total]
        assert int(ids.min()) * per_block >= INT32_LIMIT
    else:
        # Block 0 stays unused (and NaN): padded table entries and masked lookups point there.
        num_blocks = total + 7
        ids = 1 + torch.randperm(num_blocks - 1, generator=gen)[:total]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    used = ids.to(DEVICE)
    # Stale slots and unused blocks are NaN: anything read without a mask leaks into results.
    if huge_pool:
        k_cache[used] = float("nan")
        v_cache[used] = float("nan")
    else:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))

    width = max(blocks_needed)
    tables = torch.zeros((len(specs), width), dtype=torch.int32)
    q_lens, seq_lens, slots_new = [], [], []
    cursor = 0
    for i, ((seq_len, q_len), n) in enumerate(zip(specs, blocks_needed)):
        assert 1 <= q_len <= seq_len
        tables[i, :n] = ids[cursor : cursor + n].to(torch.int32)
        cursor += n
        slots = tables[i, torch.arange(seq_len) // block_size].long() * block_size + (torch.arange(seq_len) % block_size)
        ctx = seq_len - q_len
        # Cached prefix: written by the reference; the new tokens go through the kernel.
        kp = torch.randn((ctx, num_kv_heads, head_size), generator=gen).to(dtype).to(DEVICE)
        vp = torch.randn((ctx, num_kv_heads, head_size), generator=gen).to(dtype).to(DEVICE)
        write_kv_ref(kp, vp, k_cache, v_cache, slots[:ctx].to(DEVICE))
        slots_new.append(slots[ctx:])
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    num_tokens = sum(q_lens)
    slot_mapping = torch.cat(slots_new)
    # A padding token (slot -1) in the write; it has no query row in the attention batch.
    slot_mapping_w = torch.cat([slot_mapping, torch.tensor([-1])]).to(DEVICE)
    k_new = torch.randn((num_tokens + 1, num_kv_heads, head_size), generator=gen).to(dtype)
    v_new = torch.randn((num_tokens + 1, num_kv_heads, head_size), generator=gen).to(dtype)
    q = torch.randn((num_tokens, num_heads, head_size), generator=gen).to(dtype).to(DEVICE)
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=slot_mapping_w,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_list=q_lens,
        seq_lens_list=seq_lens,
    )
    # Host-side bounds checks: the interpreter has none.
    assert int(tables.max()) < num_blocks and int(slot_mapping.max()) < num_blocks * block_size
    return PagedBatch(q, k_new.to(DEVICE), v_new.to(DEVICE), k_cache, v_cache, meta, used)


def run_write_and_attention(batch: PagedBatch, dtype: torch.dtype, splits: list[int]) -> None:
    """Kernel KV write vs reference on the used blocks, then attention (2D and split-KV)."""
    meta = batch.meta
    used = batch.used_blocks
    # Reference write on a compact copy of the touched blocks (the pool itself may be huge).
    remap = {int(b): j for j, b in enumerate(used.tolist())}
    bs = batch.k_cache.shape[1]
    compact = torch.tensor(
        [remap[int(s) // bs] * bs + int(s) % bs if s >= 0 else -1 for s in meta.slot_mapping.tolist()],
        dtype=torch.int64,
        device=DEVICE,
    )
    want_k, want_v = batch.k_cache[used].clone(), batch.v_cache[used].clone()
    write_kv_ref(batch.k_new, batch.v_new, want_k, want_v, compact)
    write_kv(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, meta.slot_mapping)
    torch.testing.assert_close(batch.k_cache[used], want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache[used], want_v, atol=0, rtol=0, equal_nan=True)

    scale = batch.q.shape[-1] ** -0.5
    want = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, meta, scale)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention_2d(batch.q, batch.k_cache, batch.v_cache, meta, scale, out=out)
    check("paged_attention_2d", out, want, dtype)
    for n in splits:
        out = torch.full_like(batch.q, float("nan"))
        decode_split(batch.q, batch.k_cache, batch.v_cache, meta, scale, n, out=out)
        check(f"decode_split[{n}]", out, want, dtype)


LONG = 2011 if ON_GPU else 600
MIXED = [(LONG, LONG), (300, 45), (1, 1), (257, 1), (77, 1), (130, 17), (33, 33)]
# The 5/1 case already pads heads 5 -> 8; under the interpreter a shorter mix keeps it quick.
MIXED_5_1 = MIXED if ON_GPU else [(300, 300), (1, 1), (257, 1), (130, 17), (33, 33)]
DECODE = [(1, 1), (17, 1), (LONG, 1), (333, 1), (64, 1)]


def case_attn_4_4() -> None:
    for dtype in dtypes(torch.float16):
        run_write_and_attention(make_batch(MIXED, 4, 4, 64, 16, dtype), dtype, [])


def case_attn_8_2() -> None:
    for dtype in dtypes(torch.float32):
        run_write_and_attention(make_batch(MIXED, 8, 2, 80, 16, dtype, seed=1), dtype, [])


def case_attn_5_1() -> None:
    # Block size 32, GQA group of 5 padded to 8 rows, head 128.
    for dtype in dtypes(torch.float16):
        run_write_and_attention(make_batch(MIXED_5_1, 5, 1, 128, 32, dtype, seed=2), dtype, [])


def case_decode_split() -> None:
    configs = ((8, 2, 128, torch.float32), (5, 1, 80, torch.float16))
    for heads, kv_heads, head_size, cpu_dtype in configs:
        for dtype in dtypes(cpu_dtype):
            batch = make_batch(DECODE, heads, kv_heads, head_size, 16, dtype, seed=3)
            # 16 splits leave the short sequences with empty splits (lse = -inf).
            run_write_and_attention(batch, dtype, [1, 3, 16])


def case_engine_shapes() -> None:
    """The heads the GPU check runs: its 1B llama's (32 query / 8 KV heads of 64) in a mixed
    batch, and bench.kernels' (32 / 8 of 128) in decode, 2D and split-KV."""
    mixed = MIXED if ON_GPU else [(40, 40), (17, 1)]
    decode = DECODE if ON_GPU else [(40, 1), (3, 1)]
    for dtype in dtypes(torch.float32):
        run_write_and_attention(make_batch(mixed, 32, 8, 64, 16, dtype, seed=8), dtype, [])
        run_write_and_attention(make_batch(decode, 32, 8, 128, 16, dtype, seed=9), dtype, [1, 4])


def case_huge_pool() -> None:
    """Block ids past 2^31 elements: int32 offset math would read/write far outside the pool."""
    dtype = torch.float16
    specs = [(150, 150), (70, 1), (40, 9)]
    run_write_and_attention(make_batch(specs, 8, 2, 64, 16, dtype, huge_pool=True, seed=4), dtype, [])
    batch = make_batch([(90, 1), (3, 1)], 4, 4, 64, 16, dtype, huge_pool=True, seed=5)
    run_write_and_attention(batch, dtype, [2])


def case_norm_act() -> None:
    gen = torch.Generator().manual_seed(6)
    for dtype in DTYPES:
        for rows, hidden in ((5, 80), (3, 1000)):
            x = torch.randn((rows, hidden), generator=gen).to(dtype).to(DEVICE)
            res = torch.randn((rows, hidden), generator=gen).to(dtype).to(DEVICE)
            w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
            out, new_res = rms_norm(x, w, 1e-6)
            want, _ = rms_norm_ref(x, w, 1e-6)
            check("rms_norm", out, want, dtype)
            assert new_res is x
            out, new_res = rms_norm(x, w, 1e-6, residual=res)
            want, want_res = rms_norm_ref(x, w, 1e-6, residual=res)
            check("rms_norm+residual", out, want, dtype)
            check("rms_norm new_residual", new_res, want_res, dtype)
        for rows, inter in ((4, 80), (2, 1500)):
            x = torch.randn((rows, 2 * inter), generator=gen).to(dtype).to(DEVICE)
            check("silu_and_mul", silu_and_mul(x), silu_and_mul_ref(x), dtype)
            x = x * 3  # gelu's tails, where its tanh saturates
            check("gelu_tanh_and_mul", gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x), dtype)


def case_rotary() -> None:
    gen = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        for heads, kv_heads, head_size, rot_dim in ((5, 1, 80, 80), (4, 2, 64, 32)):
            tokens, max_pos = 9, 4096
            inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
            freqs = torch.outer(torch.arange(max_pos).float(), inv)
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
            positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
            # q/k as strided views of one qkv buffer, like the model's projections.
            qkv = torch.randn((tokens, heads + 2 * kv_heads, head_size), generator=gen)
            qkv = qkv.to(dtype).to(DEVICE)
            q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
            q_ref, k_ref = q.clone(), k.clone()
            v_before = qkv[:, heads + kv_heads :].clone()
            rotary(q, k, positions, cache)
            rotary_ref(q_ref, k_ref, positions, cache)
            check("rotary q", q, q_ref, dtype)
            check("rotary k", k, k_ref, dtype)
            assert torch.equal(qkv[:, heads + kv_heads :], v_before), "rotary touched v"


def case_e2e() -> None:
    """Greedy tokens of the engine with every op on Triton equal those of the torch ops."""
    from common.sampling_params import SamplingParams
    from gateway.llm import LLM

    model = os.environ["CONVEYOR_TEST_MODEL"]
    prompts = [[5, 17, 99, 3, 250, 31, 7], [42] * 20, [300, 301, 302], list(range(40, 73))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        # A 33-token prompt spans blocks; a 24-token step budget chunks prefills and mixes them
        # with decodes in one batch.
        llm = LLM(
            model,
            device=DEVICE,
            dtype="float32",
            attention_backend=backend,
            num_blocks=64,
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=24,
            max_num_seqs=8,  # on CUDA: four graphs to capture, not nine
        )
        assert llm.executor.ops.name == backend
        tokens[backend] = [r.token_ids for r in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"], tokens
    assert all(len(t) == 4 for t in tokens["torch"])
    print("tokens", tokens["torch"])


def case_graph_split() -> None:
    """A padded decode batch in the CUDA graphs' static buffers, with the split count a capture
    at a long max context picks, equals the unpadded batch on the 2D kernel."""
    from executor.cuda_graphs import GraphInputs
    from executor.kernels import dispatch_attention
    from executor.kernels.decode_split import choose_num_splits

    dtype = torch.float32
    batch = make_batch([(70, 1), (3, 1), (33, 1)], 8, 2, 64, 16, dtype, seed=10)
    write_kv(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    scale = 64**-0.5
    want = paged_attention_2d(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    inputs = GraphInputs(4, batch.meta.block_tables.shape[1], torch.device(DEVICE), max_seq_len=4096)
    ids = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    # make_batch's write has a padding token; the attention batch's own three slots go in.
    step = dataclasses.replace(batch.meta, slot_mapping=batch.meta.slot_mapping[:3])
    gmeta = inputs.load(ids, ids, step, 4)
    assert choose_num_splits(4, 2, gmeta.max_seq_len, 132) == 8  # what a capture on 132 SMs runs
    q = torch.cat([batch.q, torch.zeros_like(batch.q[:1])])  # the padding row's query
    got = dispatch_attention(q, batch.k_cache, batch.v_cache, gmeta, scale)
    check("graph split-KV decode", got[:3], want, dtype)


def case_compile_sm90() -> None:
    """Every kernel, at the configs the wrappers pick, built for sm_90 as the GPU JIT builds it
    (tests/sm90_build.py): no spills, and the attention kernels' K/V loads pipelined (cp.async).

    The interpreter runs kernels as Python, so this is also what catches code that only the real
    compiler rejects. Run with TRITON_INTERPRET=0.
    """
    assert os.environ.get("TRITON_INTERPRET") == "0"
    from tests import sm90_build

    seen: dict[str, sm90_build.Build] = {}
    builds = sm90_build.attention_builds(seen) + sm90_build.other_builds(seen)
    for b in builds:
        print(b.line(), flush=True)
    spilled = [b.line() for b in builds if b.spills]
    assert not spilled, spilled
    attention = [b for b in builds if b.kernel in ("_paged_attention_kernel", "_decode_split_kernel")]
    assert attention and all(b.cp_async > 0 for b in attention), [b.line() for b in attention]


CASES = {
    "attn_4_4": case_attn_4_4,
    "attn_8_2": case_attn_8_2,
    "attn_5_1": case_attn_5_1,
    "decode_split": case_decode_split,
    "engine_shapes": case_engine_shapes,
    "huge_pool": case_huge_pool,
    "norm_act": case_norm_act,
    "rotary": case_rotary,
    "graph_split": case_graph_split,
    "e2e": case_e2e,
    "compile_sm90": case_compile_sm90,
}


def main(argv: list[str]) -> int:
    names = argv or list(CASES)
    for name in names:
        CASES[name]()
        print(f"OK {name} on {DEVICE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
