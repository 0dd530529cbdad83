"""The fused-MoE Triton kernel against a plain torch reference, one case per process:
``python -m tests.fused_moe_cases <case>...``.

Run by tests/test_family_kernels.py (under Triton's interpreter without a GPU) and by
bench/device_check.sh on a GPU (compiled, bf16 too). Imports no pytest.
"""

from __future__ import annotations

import itertools
import sys

import torch

from executor import ops_torch
from executor.kernels import OPS
from executor.kernels.fused_moe import fused_moe, moe_align_block_size
from tests.kernel_cases import DEVICE, ON_GPU, check, dtypes


def act_ref(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The two activations of `executor.ops.Ops.fused_moe`, from their definitions."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=7.0)
    up = up.clamp(-7.0, 7.0)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """Token by token, expert by expert, in fp64:
    ``out[t] = sum_j w[t, j] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])``, the activation
    rounded to x's dtype (the model dtype holds the intermediate, as in transformers)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e].double() @ x[t].double()
            if b13 is not None:
                h = h + b13[e].double()
            a = act_ref(h[:inter], h[inter:], activation).to(x.dtype).double()
            y = w2[e].double() @ a
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(topk_weights[t, j]) * y
    return out.to(x.dtype)


def make_inputs(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, bias: bool, dtype: torch.dtype, seed: int
) -> dict:
    """Random weights scaled like a trained layer's (unit-size activations), softmax-top-k routing."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)

    logits = torch.randn((tokens, experts), generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return dict(
        x=rand(tokens, hidden),
        w13=rand(experts, 2 * inter, hidden, scale=hidden**-0.5),
        w2=rand(experts, hidden, inter, scale=inter**-0.5),
        topk_weights=weights.to(DEVICE),
        topk_ids=ids.to(DEVICE),
        b13=rand(experts, 2 * inter, scale=0.5) if bias else None,
        b2=rand(experts, hidden, scale=0.5) if bias else None,
    )


def case_align() -> None:
    """Every assignment exactly once, grouped by expert in token order, runs padded to BLOCK_M."""
    gen = torch.Generator().manual_seed(1)
    for tokens, experts, top_k, block_m in ((1, 4, 2, 16), (17, 8, 2, 16), (64, 8, 1, 16), (64, 4, 2, 64), (5, 128, 8, 16)):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
        sorted_ids, expert_ids = moe_align_block_size(ids, block_m, experts)
        n = tokens * top_k
        flat = ids.reshape(-1).cpu()
        got = sorted_ids.cpu().view(-1, block_m)
        blocks = expert_ids.cpu()
        assert got.shape[0] == blocks.numel()
        real = got[got < n]
        assert sorted(real.tolist()) == list(range(n)), "each assignment once"
        for b in range(blocks.numel()):
            rows = got[b][got[b] < n]
            if int(blocks[b]) < 0:
                assert rows.numel() == 0, "a block past the end holds no row"
                continue
            assert rows.numel() > 0 and bool((flat[rows] == blocks[b]).all()), "a block holds one expert"
            assert rows.tolist() == sorted(rows.tolist()), "token order within an expert"
        used = blocks[blocks >= 0]
        assert used.tolist() == sorted(used.tolist()), "experts in order"
        counts = torch.bincount(flat, minlength=experts)
        assert int((blocks >= 0).sum()) == int(((counts + block_m - 1) // block_m).sum())


T_VALUES = (1, 3, 17, 64)


def case_fused_moe() -> None:
    """T in (1, 3, 17, 64), E in (4, 8), k in (1, 2), hidden and intermediate multiples of 16 and
    not, both activations, with and without biases (fp32 on the CPU: exact to fp32 tolerance)."""
    shapes = ((32, 48), (40, 24))  # (hidden, intermediate): multiples of 16, then not
    combos = list(itertools.product(T_VALUES, (4, 8), (1, 2)))
    assert OPS.fused_moe is fused_moe, "the Triton backend's Ops runs this kernel"
    seed = 0
    for dtype in dtypes(torch.float32):
        for i, (tokens, experts, top_k) in enumerate(combos):
            hidden, inter = shapes[i % 2]
            activation = ("silu", "swigluoai")[(i // 2) % 2]
            bias = i % 3 == 0 or activation == "swigluoai"
            seed += 1
            inp = make_inputs(tokens, experts, top_k, hidden, inter, bias, dtype, seed)
            name = f"T={tokens} E={experts} k={top_k} H={hidden} I={inter} {activation} bias={bias}"
            want = fused_moe_ref(**inp, activation=activation)
            check(f"fused_moe {name}", fused_moe(**inp, activation=activation), want, dtype)
            check(f"torch ops fused_moe {name}", ops_torch.fused_moe(**inp, activation=activation), want, dtype)


def case_fused_moe_wide() -> None:
    """Half precision and wider layers: many experts with few tokens each (decode's case, most
    blocks empty), and more tokens than experts (the larger tiles); gpt-oss-like clamps hit."""
    configs = [(3, 16, 4, 64, 80, "silu", False), (70, 8, 2, 96, 64, "swigluoai", True)]
    if ON_GPU:
        # Qwen3-30B-A3B's decode; gpt-oss's widths over fewer experts (weights made on the host).
        configs += [(1, 128, 8, 2048, 768, "silu", False), (512, 8, 4, 2880, 2880, "swigluoai", True)]
    for dtype in dtypes(torch.float16):
        for seed, (tokens, experts, top_k, hidden, inter, activation, bias) in enumerate(configs):
            inp = make_inputs(tokens, experts, top_k, hidden, inter, bias, dtype, 100 + seed)
            if activation == "swigluoai":
                inp["x"] = inp["x"] * 4  # gate and up past the +-7 clamps
            got = fused_moe(**inp, activation=activation)
            want = fused_moe_ref(**inp, activation=activation) if tokens * top_k <= 256 else None
            if want is None:  # the per-token reference is slow at this size: batch it per expert
                want = _per_expert_ref(**inp, activation=activation)
            check(f"fused_moe T={tokens} E={experts} k={top_k} H={hidden} I={inter} {activation}", got, want, dtype)


def _per_expert_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """The same sum in fp32, batched over each expert's tokens (for the large GPU shapes)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok].float() @ w13[e].float().T
        if b13 is not None:
            h = h + b13[e].float()
        y = act_ref(h[:, :inter], h[:, inter:], activation).to(x.dtype).float() @ w2[e].float().T
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


CASES = {"align": case_align, "fused_moe": case_fused_moe, "fused_moe_wide": case_fused_moe_wide}


def main(argv: list[str]) -> int:
    for name in argv or list(CASES):
        CASES[name]()
        print(f"OK {name} on {DEVICE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
