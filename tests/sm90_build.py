"""Build the Triton kernels for an H100/H200 (sm_90) as the GPU JIT would, without a GPU.

    TRITON_INTERPRET=0 python -m tests.sm90_build [--all]

Each kernel is launched through its real wrapper on small CPU tensors; the launch is caught
before it reaches a driver and its arguments go through Triton's own JIT binder, so the build
gets the specialisation a GPU run gets: 16-byte divisibility on aligned pointers and on ints that
are multiples of 16, ints equal to 1 as constants. Without it ptxas sees scalar loads, no
``cp.async`` and spills that the GPU build does not have. Each build reports ptxas' registers,
spill bytes and stack frame, the shared memory, and the loads in its PTX (``cp.async``, vector
``ld.global.v2/v4``, scalar ``ld.global``). The shipped tiles must build without spills
(tests/kernel_cases.py's ``compile_sm90`` asserts it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler; kernels must be defined after this

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from executor.attention_metadata import AttentionMetadata  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


@dataclass(slots=True)
class Build:
    """One kernel at one configuration as ptxas built it for sm_90."""

    kernel: str
    config: str
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack: int  # bytes of stack frame per thread
    shared: int  # bytes of shared memory per program
    cp_async: int  # cp.async instructions in the PTX (pipelined global->shared copies)
    vector_loads: int  # ld.global.v2 / .v4
    scalar_loads: int  # other ld.global

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def line(self) -> str:
        return (
            f"{self.kernel} {self.config}: regs={self.registers} spill={self.spill_stores}/{self.spill_loads}B "
            f"stack={self.stack}B smem={self.shared}B cp.async={self.cp_async} "
            f"ld.v={self.vector_loads} ld.scalar={self.scalar_loads}"
        )


@contextlib.contextmanager
def caught_launches(*kernels: JITFunction) -> Iterator[list[tuple[JITFunction, tuple, dict]]]:
    """Launches of ``kernels`` are recorded (kernel, args, kwargs) instead of run."""
    calls: list[tuple[JITFunction, tuple, dict]] = []
    for k in kernels:

        def record(*args: Any, grid: Any, warmup: bool, _k: JITFunction = k, **kwargs: Any) -> None:
            calls.append((_k, args, kwargs))

        k.run = record  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        for k in kernels:
            del k.run


def _ptxas_numbers(log: str) -> tuple[int, int, int, int]:
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return (
        int(regs.group(1)) if regs else -1,
        int(spill.group(1)) if spill else 0,
        int(spill.group(2)) if spill else 0,
        int(stack.group(1)) if stack else 0,
    )


def build(kernel: JITFunction, args: tuple, kwargs: dict, config: str, seen: dict[str, Build] | None = None) -> Build:
    """Compile one caught launch for sm_90 with the JIT's specialisation of its arguments.

    ``seen``: builds by source hash, so a launch that specialises like an earlier one (another
    head size of the same padding, say) reuses its numbers instead of compiling again.
    """
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    key = src.hash() + str(sorted(options.__dict__.items()))
    if seen is not None and key in seen:
        return dataclasses.replace(seen[key], config=config)
    nvidia, compilation = triton.knobs.nvidia, triton.knobs.compilation
    old = nvidia.dump_ptxas_log, compilation.always_compile
    # ptxas -v prints registers, spills and stack; a cache hit would skip ptxas and its log.
    nvidia.dump_ptxas_log, compilation.always_compile = True, True
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=SM90, options=options.__dict__)
    finally:
        nvidia.dump_ptxas_log, compilation.always_compile = old
    regs, stores, loads, stack = _ptxas_numbers(log.getvalue())
    ptx = compiled.asm["ptx"]
    vector = len(re.findall(r"\bld\.global(?:\.\w+)*\.v[248]\.", ptx))
    scalar = len(re.findall(r"\bld\.global\b", ptx)) - vector
    result = Build(
        kernel=kernel.__name__,
        config=config,
        registers=regs,
        spill_stores=stores,
        spill_loads=loads,
        stack=stack,
        shared=compiled.metadata.shared,
        cp_async=len(re.findall(r"\bcp\.async\.(?:ca|cg)", ptx)),
        vector_loads=vector,
        scalar_loads=scalar,
    )
    if seen is not None:
        seen[key] = result
    return result


def build_calls(run: Callable[[], object], kernels: tuple[JITFunction, ...], config: str, seen: dict[str, Build]) -> list[Build]:
    """Every launch ``run`` makes of ``kernels``, built for sm_90."""
    with caught_launches(*kernels) as calls:
        run()
    return [build(k, a, kw, config, seen) for k, a, kw in calls]


def _attention_batch(
    query_lens: list[int], seq_len: int, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Tensors shaped as the model passes them (values unused: nothing runs)."""
    n, tokens, block = len(query_lens), sum(query_lens), 16
    width = -(-seq_len // block)
    q = torch.empty((tokens, heads, head_size), dtype=dtype)
    cache = torch.empty((n * width + 1, block, kv_heads, head_size), dtype=dtype)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.full((n,), seq_len, dtype=torch.int32),
        block_tables=torch.zeros((n, width), dtype=torch.int32),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=seq_len,
        query_lens_list=list(query_lens),
        seq_lens_list=[seq_len] * n,
    )
    return q, cache, cache.clone(), meta


# (query heads, KV heads, head size): Llama-3 8B/1B, Qwen (GQA 7, head 128), a head of 80, Gemma 2
# (head 256), gpt-oss (head 64, GQA 8).
ATTENTION_HEADS = ((32, 8, 128), (32, 8, 64), (28, 4, 128), (32, 8, 80), (16, 8, 256), (64, 8, 64))
SHIPPED_HEADS = ((32, 8, 128), (32, 8, 80), (16, 8, 256))
# (name, query lengths, sequence length, KV splits; 1 = the 2D kernel).
ATTENTION_BATCHES = (
    ("decode", [1] * 8, 4096, 1),
    ("decode split4", [1] * 2, 4096, 4),
    ("prefill", [512, 512], 512, 1),
    ("mixed", [200, 1, 1, 1], 512, 1),
)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, variant: Any, splits: int
) -> torch.Tensor:
    import importlib

    pa, ds = (importlib.import_module(f"executor.kernels.{m}") for m in ("paged_attention", "decode_split"))
    scale = q.shape[-1] ** -0.5
    if splits > 1:
        return ds.decode_split(q, k, v, meta, scale, splits, variant=variant)
    return pa.paged_attention_2d(q, k, v, meta, scale, variant=variant)


def attention_builds(seen: dict[str, Build], all_shapes: bool = False) -> list[Build]:
    """The attention kernels at the configurations the wrappers pick: decode (2D and split-KV),
    prefill and mixed batches, bf16 and fp32, with and without the variant switches."""
    import importlib

    # import_module: the package re-exports functions under some of its modules' names.
    pa, ds = (importlib.import_module(f"executor.kernels.{m}") for m in ("paged_attention", "decode_split"))

    kernels = (pa._paged_attention_kernel, ds._decode_split_kernel, ds._merge_splits_kernel)
    out = []
    heads_list = ATTENTION_HEADS if all_shapes else SHIPPED_HEADS
    for heads, kv_heads, head_size in heads_list:
        for dtype in (torch.bfloat16, torch.float32):
            tag = f"{heads}/{kv_heads}x{head_size} {str(dtype).removeprefix('torch.')}"
            variants: list[dict[str, Any]] = [{}]
            if all_shapes or dtype == torch.bfloat16:
                variants.append(dict(sliding_window=128, sinks=torch.zeros(heads), softcap=30.0))
            for extra in variants:
                vtag = tag + (" window+sinks+softcap" if extra else "")
                for name, qlens, seq_len, splits in ATTENTION_BATCHES:
                    q, k, v, meta = _attention_batch(qlens, seq_len, heads, kv_heads, head_size, dtype)
                    variant = pa.Variant.of(q, extra.get("sliding_window"), extra.get("sinks"), extra.get("softcap"))
                    run = functools.partial(_attention, q, k, v, meta, variant, splits)
                    out += build_calls(run, kernels, f"{name} {vtag}", seen)
    return out


def other_builds(seen: dict[str, Build]) -> list[Build]:
    """KV write, RMSNorm, rotary, the gated activations and the fused-MoE GEMMs at model shapes."""
    import importlib

    kv, rn, ro, act, fm = (
        importlib.import_module(f"executor.kernels.{m}") for m in ("kv_write", "rms_norm", "rotary", "activation", "fused_moe")
    )
    bf = torch.bfloat16
    out = []
    k_new = torch.empty((64, 8, 128), dtype=bf)
    cache = torch.empty((33, 16, 8, 128), dtype=bf)
    slots = torch.zeros(64, dtype=torch.int64)
    out += build_calls(lambda: kv.write_kv(k_new, k_new, cache, cache, slots), (kv._kv_write_kernel,), "64 tokens 8x128", seen)
    x = torch.empty((64, 4096), dtype=bf)
    w = torch.empty(4096, dtype=bf)
    out += build_calls(lambda: rn.rms_norm(x, w, 1e-6, residual=x.clone()), (rn._rms_norm_kernel,), "hidden 4096 +residual", seen)
    qkv = torch.empty((64, 48, 128), dtype=bf)
    cos_sin = torch.empty((4096, 128), dtype=torch.float32)
    positions = torch.zeros(64, dtype=torch.int64)
    out += build_calls(lambda: ro.rotary(qkv[:, :32], qkv[:, 32:40], positions, cos_sin), (ro._rotary_kernel,), "32/8x128", seen)
    gate_up = torch.empty((64, 2 * 14336), dtype=bf)
    out += build_calls(lambda: act.silu_and_mul(gate_up), (act._silu_and_mul_kernel,), "inter 14336", seen)
    out += build_calls(lambda: act.gelu_tanh_and_mul(gate_up), (act._gelu_tanh_and_mul_kernel,), "inter 14336", seen)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = torch.empty((experts, 2 * inter, hidden), dtype=bf)
    w2 = torch.empty((experts, hidden, inter), dtype=bf)
    for tokens in (1, 512):
        xm = torch.empty((tokens, hidden), dtype=bf)
        weights = torch.full((tokens, top_k), 1.0 / top_k)
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)

        for act_name in ("silu", "swigluoai"):
            # gpt-oss: biases and its clamped SwiGLU.
            biases = (torch.empty((experts, 2 * inter), dtype=bf), torch.empty((experts, hidden), dtype=bf))
            b13, b2 = biases if act_name == "swigluoai" else (None, None)

            def moe(xm=xm, weights=weights, ids=ids, b13=b13, b2=b2, act_name=act_name) -> object:
                return fm.fused_moe(xm, w13, w2, weights, ids, b13, b2, activation=act_name)

            tag = f"E{experts}k{top_k} {hidden}x{inter} T={tokens} {act_name}"
            out += build_calls(moe, (fm._moe_gemm_kernel,), tag, seen)
    return out


def main(argv: list[str]) -> int:
    seen: dict[str, Build] = {}
    builds = attention_builds(seen, all_shapes="--all" in argv) + other_builds(seen)
    for b in builds:
        print(b.line(), flush=True)
    spilled = [b for b in builds if b.spills]
    print(f"{len(builds)} builds, {len(spilled)} with spills")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
