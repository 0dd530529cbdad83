"""The torch `fused_moe` against a per-token reference, and the MoE layer against transformers' own blocks.

The layer tests build each family's sparse block with transformers (Qwen3-MoE, Qwen2-MoE, Mixtral,
gpt-oss), copy its weights into the engine's layout and compare outputs: transformers is the
oracle for routing (softmax/top-k/renormalisation, gpt-oss's top-k-then-softmax), the shared
expert's sigmoid gate and gpt-oss's interleaved, clamped SwiGLU with biases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor.layers.moe import MoE, Router, SharedExpert, shard_b13, shard_intermediate
from executor.moe_torch import expert_activation, fused_moe
from executor.ops_torch import make_ops

pytestmark = pytest.mark.model


def reference_moe(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, activation="silu"):
    """One token and one choice at a time: the definition in `executor.ops.Ops`."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = x[t : t + 1].double() @ w13[e].double().T
            if b13 is not None:
                h = h + b13[e].double()
            y = expert_activation(h, activation) @ w2[e].double().T
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(topk_weights[t, j]) * y[0]
    return out


def _random_case(t: int, e: int, k: int, h: int, i: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5 * 3  # large enough to hit the clamp
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    b13 = torch.randn(e, 2 * i, generator=g) if bias else None
    b2 = torch.randn(e, h, generator=g) if bias else None
    logits = torch.randn(t, e, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, w13, w2, weights, ids, b13, b2


@pytest.mark.parametrize("activation,bias", [("silu", False), ("silu", True), ("swigluoai", True), ("swigluoai", False)])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 8, 2), (64, 16, 4), (5, 4, 1), (3, 32, 8)])
def test_fused_moe_matches_reference(activation: str, bias: bool, t: int, e: int, k: int) -> None:
    x, w13, w2, weights, ids, b13, b2 = _random_case(t, e, k, 32, 24, bias)
    got = fused_moe(x, w13, w2, weights, ids, b13=b13, b2=b2, activation=activation)
    want = reference_moe(x, w13, w2, weights, ids, b13, b2, activation)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_swigluoai_clamps() -> None:
    """The clamp is real: huge gate/up values give the limit's value, not overflow."""
    h = torch.tensor([[100.0, -100.0, 100.0, -100.0]])  # gate (100, -100), up (100, -100)
    out = expert_activation(h, "swigluoai")
    want_0 = (7.0 + 1) * 7.0 * torch.sigmoid(torch.tensor(7.0 * 1.702))
    torch.testing.assert_close(out[0, 0], want_0)
    assert abs(float(out[0, 1])) < 1e-30  # gate -100: sigmoid underflows; (up + 1) = -6


def test_fused_moe_bf16_and_edge_cases() -> None:
    x, w13, w2, weights, ids, _, _ = _random_case(16, 8, 2, 32, 24, False)
    got = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_moe(x, w13, w2, weights, ids).float(), rtol=0.05, atol=0.05)
    # No tokens; all tokens on one expert (the others idle).
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
    same = torch.full((16, 1), 3, dtype=torch.long)
    ones = torch.ones(16, 1)
    want = reference_moe(x, w13, w2, ones, same)
    torch.testing.assert_close(fused_moe(x, w13, w2, ones, same).double(), want, rtol=1e-5, atol=1e-5)


def test_fused_moe_unknown_activation() -> None:
    x, w13, w2, weights, ids, _, _ = _random_case(2, 4, 2, 8, 4, False)
    with pytest.raises(ValueError, match="unknown MoE activation"):
        fused_moe(x, w13, w2, weights, ids, activation="gelu")


# -- the layer against transformers ------------------------------------------------------------

H, I_MOE, E, K = 32, 24, 8, 2


def _tiny(cfg_cls, **kw):
    return cfg_cls(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, **kw)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _stacked(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fused expert tensors as w13 ``[E, 2I, H]`` (gate then up) and w2 ``[E, H, I]``."""
    return experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = _tiny(Qwen3MoeConfig, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I_MOE, norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    _randomize(block, 1)
    w13, w2 = _stacked(block.experts)
    layer = MoE(make_ops(), Router(K, "softmax", norm_topk_prob, True), block.gate.weight.detach(), w13, w2)
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = block(x)[0]
    torch.testing.assert_close(layer(x[0]), want, rtol=1e-5, atol=1e-5)


def test_qwen2_moe_block_with_shared_expert() -> None:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = _tiny(
        Qwen2MoeConfig, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I_MOE, shared_expert_intermediate_size=40
    )
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomize(block, 3)
    w13, w2 = _stacked(block.experts)
    se = block.shared_expert
    gate_up = torch.cat([se.gate_proj.weight, se.up_proj.weight]).detach()
    down = se.down_proj.weight.detach()
    shared = SharedExpert(lambda x: F.linear(F.silu(F.linear(x, gate_up[:40])) * F.linear(x, gate_up[40:]), down),
                          block.shared_expert_gate.weight.detach())  # fmt: skip
    layer = MoE(make_ops(), Router(K, "softmax", False, True), block.gate.weight.detach(), w13, w2, shared=shared)
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(x)[0]
    torch.testing.assert_close(layer(x[0]), want, rtol=1e-5, atol=1e-5)


def test_mixtral_block() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = _tiny(MixtralConfig, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I_MOE)
    block = MixtralSparseMoeBlock(cfg).eval()
    _randomize(block, 5)
    w13, w2 = _stacked(block.experts)
    layer = MoE(make_ops(), Router(K, "softmax", True), block.gate.weight.detach(), w13, w2)
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = block(x)
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(layer(x[0]), want[0], rtol=1e-5, atol=1e-5)


def gpt_oss_experts(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor):
    """gpt-oss's stored layout (``[E, H, 2I]`` with gate/up columns interleaved, ``[E, I, H]``) as
    (w13, b13, w2, b2) in `fused_moe`'s."""
    w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    b13 = torch.cat([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]], dim=-1)
    return w13, b13, down.transpose(1, 2).contiguous(), down_bias


def test_gpt_oss_block() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = _tiny(GptOssConfig, num_local_experts=E, num_experts_per_tok=K, intermediate_size=I_MOE)
    block = GptOssMLP(cfg).eval()
    _randomize(block, 7)
    with torch.no_grad():
        block.experts.gate_up_proj.mul_(10)  # push some activations past the clamp (7.0)
    ex = block.experts
    w13, b13, w2, b2 = gpt_oss_experts(
        ex.gate_up_proj.detach(), ex.gate_up_proj_bias.detach(), ex.down_proj.detach(), ex.down_proj_bias.detach()
    )
    r = block.router
    layer = MoE(make_ops(), Router(K, "topk_softmax"), r.weight.detach(), w13, w2, router_bias=r.bias.detach(),
                b13=b13, b2=b2, activation="swigluoai")  # fmt: skip
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = block(x)[0][0]
        gate = F.linear(x[0], ex.gate_up_proj.detach()[0].T)[:, ::2] + ex.gate_up_proj_bias.detach()[0, ::2]
    assert bool((gate > 7.0).any())  # the clamp matters in this case
    torch.testing.assert_close(layer(x[0]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_per_expert_tensor_parallel_shards_sum_to_the_whole(activation: str) -> None:
    """Per-expert TP: the ranks' partial outputs (b2 on rank 0 only) add up to the unsharded layer."""
    x, w13, w2, _, _, b13, b2 = _random_case(24, 8, 2, 32, 24, True, seed=9)
    router_w = torch.randn(8, 32, generator=torch.Generator().manual_seed(10))
    ops, router = make_ops(), Router(2, "topk_softmax" if activation == "swigluoai" else "softmax", True)
    assert b13 is not None and b2 is not None
    whole = MoE(ops, router, router_w, w13, w2, b13=b13, b2=b2, activation=activation)(x)
    world, inter = 3, 24
    total = torch.zeros_like(whole)
    for rank in range(world):
        start, end = rank * inter // world, (rank + 1) * inter // world
        w13_r, w2_r = shard_intermediate(w13, w2, start, end)
        b2_r = b2 if rank == 0 else torch.zeros_like(b2)
        part = MoE(ops, router, router_w, w13_r, w2_r, b13=shard_b13(b13, start, end), b2=b2_r, activation=activation)
        total += part(x)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_layer_refuses_inconsistent_shapes() -> None:
    x, w13, w2, _, _, _, _ = _random_case(2, 4, 2, 8, 4, False)
    with pytest.raises(ValueError, match="expert count"):
        MoE(make_ops(), Router(2), torch.zeros(5, 8), w13, w2)
    with pytest.raises(ValueError, match="top_k"):
        MoE(make_ops(), Router(5), torch.zeros(4, 8), w13, w2)
    with pytest.raises(ValueError, match="scoring"):
        Router(2, "sigmoid")
