"""The MoE layer's time against a dense MLP of the same active parameters, in the same run.

    python -m bench.moe_layer                       # 8 experts, top-2, hidden 512, expert width 512
    python -m bench.moe_layer --experts 64 --top-k 8 --moe-intermediate 128 --tokens 1,32,512
    OMP_NUM_THREADS=1 python -m bench.moe_layer --clock cpu   # steadier on a shared machine

The MoE layer (`executor.layers.moe.MoE`: router, top-k, `Ops.fused_moe` of the chosen backend)
runs ``top_k`` experts of width ``moe_intermediate`` per token; the dense MLP (the engine's packed
`Linear` gate/up and down, `silu_and_mul`) has width ``top_k * moe_intermediate``: the same
multiply-adds per token. Their ratio is the cost of routing, sorting by expert and the smaller,
separate per-expert matmuls. Random routing logits spread tokens over the experts as a trained
router roughly does. Prints one table row per token count (median of ``--reps`` runs each,
interleaved so that load on a shared machine hits both alike).
"""

from __future__ import annotations

import argparse
import statistics
import time

from executor.threads import set_openmp_env_defaults

set_openmp_env_defaults()  # the engine's thread default: before torch loads OpenMP

import torch  # noqa: E402

from executor.backends import get_ops  # noqa: E402
from executor.layers.linear import Linear  # noqa: E402
from executor.layers.moe import MoE, Router  # noqa: E402


def _timed(fn, x: torch.Tensor, device: str, clock) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = clock()
    fn(x)
    if device == "cuda":
        torch.cuda.synchronize()
    return clock() - t


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a markdown table."""
    ap = argparse.ArgumentParser(prog="python -m bench.moe_layer", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--tokens", default="1,16,128,512", help="comma-separated batch sizes (tokens)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="cpu: this process's CPU time (steadier on a shared machine; use with OMP_NUM_THREADS=1)",
    )
    args = ap.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    h, e, k, i = args.hidden, args.experts, args.top_k, args.moe_intermediate
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / fan_in**0.5).to(dev, dtype)

    ops = get_ops(args.backend)
    moe = MoE(ops, Router(k, "softmax", True), rand(e, h, fan_in=h), rand(e, 2 * i, h, fan_in=h), rand(e, h, i, fan_in=i))
    gate_up, down = Linear(rand(2 * k * i, h, fan_in=h)), Linear(rand(h, k * i, fan_in=k * i))

    def dense(x: torch.Tensor) -> torch.Tensor:
        return down(ops.silu_and_mul(gate_up(x)))

    active = 3 * h * i * k
    print(
        f"hidden={h} experts={e} top_k={k} moe_intermediate={i} (dense width {k * i}; {active / 1e6:.2f}M active "
        f"params, {3 * h * i * e / 1e6:.2f}M expert params) backend={args.backend} device={args.device} "
        f"dtype={args.dtype} threads={torch.get_num_threads()} clock={args.clock}"
    )
    print("\n| tokens | MoE ms | dense ms | MoE / dense |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, h, generator=g).to(dev, dtype)
            moe(x), dense(x)  # warm-up: oneDNN primitives, allocator
            t_moe, t_dense = [], []
            for _ in range(args.reps):
                t_moe.append(_timed(moe, x, args.device, clock))
                t_dense.append(_timed(dense, x, args.device, clock))
            m, d = statistics.median(t_moe) * 1e3, statistics.median(t_dense) * 1e3
            print(f"| {tokens} | {m:.3f} | {d:.3f} | {m / d:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
