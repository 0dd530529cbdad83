"""The shared layers' math against transformers and naive references: rotary scaling types,
and paged attention with sliding windows, attention sinks and soft-capping."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from executor.attention_metadata import AttentionMetadata
from executor.layers.rotary import inv_freq_and_factor
from executor.model_config import rope_params
from executor.ops_torch import gelu_tanh_and_mul, make_ops, paged_attention

pytestmark = pytest.mark.model

HEAD_DIM = 16


def _hf_rope(config: Any, kind: str, **kwargs: Any) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), **kwargs)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "truncate": False},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=["linear", "llama3", "yarn", "yarn-untruncated", "dynamic"],
)
def test_rotary_types_match_transformers(params: dict) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        rope_parameters={**params, "rope_theta": 1e4},
    )
    want, want_factor = _hf_rope(config, params["rope_type"])
    got, factor = inv_freq_and_factor(rope_params(config.to_dict()), HEAD_DIM, 2048)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor)


def test_longrope_short_range_and_partial_rotary_match_transformers() -> None:
    from transformers import Phi3Config

    short = [1.0, 1.5, 2.0, 3.0]
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=2048,
        original_max_position_embeddings=512,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
            "short_factor": short,
            "long_factor": [2 * f for f in short],
        },
    )
    want, want_factor = _hf_rope(config, "longrope")  # no seq_len: the short factors
    got, factor = inv_freq_and_factor(rope_params(config.to_dict()), 8, 2048)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor) and factor > 1


def naive(q, k_cache, v_cache, q_lens, s_lens, tables, scale, window=None, sinks=None, softcap=None):
    """Per sequence and token: the visible keys gathered one by one, the softmax written out."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    rep = q.shape[1] // hkv
    outs, start = [], 0
    for ql, sl, table in zip(q_lens, s_lens, tables):
        for j in range(ql):
            p = sl - ql + j
            lo = 0 if window is None else max(0, p - window + 1)
            slots = [table[x // bs] * bs + x % bs for x in range(lo, p + 1)]
            k = k_cache.view(-1, hkv, d)[slots].repeat_interleave(rep, dim=1)
            v = v_cache.view(-1, hkv, d)[slots].repeat_interleave(rep, dim=1)
            s = torch.einsum("hd,khd->hk", q[start + j], k) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                m = torch.maximum(s.max(-1).values, sinks)
                e = torch.exp(s - m[:, None])
                out = torch.einsum("hk,khd->hd", e, v) / (e.sum(-1) + torch.exp(sinks - m))[:, None]
            else:
                out = torch.einsum("hk,khd->hd", s.softmax(-1), v)
            outs.append(out)
        start += ql
    return torch.stack(outs)


def random_batch(seed: int, hq: int = 6, hkv: int = 2, d: int = 8, bs: int = 4):
    g = torch.Generator().manual_seed(seed)
    nblocks = 200
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    n = int(torch.randint(1, 8, (1,), generator=g))
    q_lens, s_lens, tables = [], [], []
    free = torch.randperm(nblocks, generator=g).tolist()
    for _ in range(n):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        sl = int(torch.randint(1, 28, (1,), generator=g))
        ql = 1 if kind == 0 else sl if kind == 1 else int(torch.randint(1, sl + 1, (1,), generator=g))
        q_lens.append(ql)
        s_lens.append(sl)
        tables.append([free.pop() for _ in range(-(-sl // bs))])
    q = torch.randn(sum(q_lens), hq, d, generator=g) * 2
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
        query_lens_list=q_lens,
        seq_lens_list=s_lens,
    )
    return q, k_cache, v_cache, meta, tables


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "extra",
    [
        dict(sliding_window=5),
        dict(sliding_window=1),
        dict(sliding_window=20),  # longer than some batches' sequences: the plain path there
        dict(softcap=1.5),
        dict(sinks=True),
        dict(sliding_window=7, softcap=3.0, sinks=True),
    ],
    ids=["window", "window-1", "window-20", "softcap", "sinks", "all"],
)
def test_paged_attention_variants_match_naive(seed: int, extra: dict) -> None:
    """Mixed batches of decodes, whole prompts and chunks, each variant against the naive loop;
    the memoised per-executor ops (a plan and its masks shared by layers) agree with it too."""
    q, k_cache, v_cache, meta, tables = random_batch(seed)
    kwargs = dict(extra)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(seed)) * 2
    want = naive(
        q,
        k_cache,
        v_cache,
        meta.query_lens_list,
        meta.seq_lens_list,
        tables,
        0.3,
        window=kwargs.get("sliding_window"),
        sinks=kwargs.get("sinks"),
        softcap=kwargs.get("softcap"),
    )
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.3, **kwargs), want, atol=1e-5, rtol=1e-5)
    ops = make_ops()
    plain = ops.paged_attention(q, k_cache, v_cache, meta, 0.3)  # a full layer, then a windowed one
    torch.testing.assert_close(ops.paged_attention(q, k_cache, v_cache, meta, 0.3, **kwargs), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        plain, naive(q, k_cache, v_cache, meta.query_lens_list, meta.seq_lens_list, tables, 0.3), atol=1e-5, rtol=1e-5
    )


def test_gelu_tanh_and_mul() -> None:
    x = torch.randn(5, 12)
    want = torch.nn.functional.gelu(x[:, :6], approximate="tanh") * x[:, 6:]
    torch.testing.assert_close(gelu_tanh_and_mul(x), want)
