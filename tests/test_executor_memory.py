"""Executor memory: packed CPU linears see only a bounded set of row counts.

oneDNN keeps one JIT-compiled primitive (~0.55 MB) per (weight shape, row count) in its caches, so
an executor that hands it every token count of continuous batching grows its RSS with each new
count (see `executor.layers.linear.row_bucket`). These tests check the mechanism, not RSS numbers;
``python -m bench.executor_rss`` shows the plateau itself.
"""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, ModelConfig, ParallelConfig
from common.sampling_params import SamplingParams
from executor.input_batch import Batch
from executor.layers.linear import Linear, row_bucket

pytestmark = pytest.mark.model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def test_row_bucket_is_a_small_cover_with_little_padding() -> None:
    buckets = {row_bucket(rows) for rows in range(1, 2049)}
    assert len(buckets) == 72  # 1..16, then 8 per power of two up to 2048
    assert len({row_bucket(rows) for rows in range(1, 1 << 16)}) < 150  # logarithmic, not linear
    for rows in range(1, 5000):
        b = row_bucket(rows)
        assert rows <= b < rows * 1.125 + 1 and row_bucket(b) == b
    assert [row_bucket(r) for r in (1, 7, 16, 17, 64, 65, 300, 2048)] == [1, 7, 16, 18, 64, 72, 320, 2048]


@needs_onednn
def test_padded_linear_matches_plain_matmul() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 48), torch.randn(200)
    layer = Linear(weight, bias)
    assert layer.packed is not None
    for rows in (1, 17, 33, 100, 300):
        x = torch.randn(rows, 48)
        y = layer(x)
        assert y.shape == (rows, 200) and y.is_contiguous()
        torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_executor_runs_packed_linears_on_bucketed_row_counts(tiny_model, monkeypatch) -> None:
    from executor.model_executor import ModelExecutor

    ex = ModelExecutor(
        # Every step through oneDNN (the C decode kernel would take the one-token ones).
        ModelConfig(str(tiny_model("llama")), dtype="float32", device="cpu", cpu_decode_kernel="off"),
        ParallelConfig(),
        CacheConfig(block_size=16, num_blocks=160),
    )
    seen: list[int] = []
    op = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args):
        seen.append(x.shape[0])
        return op(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    params = SamplingParams(temperature=0, max_tokens=1)
    token_counts = range(1, 301)
    for n in token_counts:  # a prompt of every length from 1 to 300 tokens, as one prefill each
        batch = Batch(
            request_ids=["r"],
            input_ids=[(7 * i) % 500 + 5 for i in range(n)],
            positions=list(range(n)),
            slot_mapping=list(range(n)),
            query_lens=[n],
            seq_lens=[n],
            block_tables=[list(range(-(-n // 16)))],
            sample=[True],
            output_lens=[0],
            sampling_params=[params],
        )
        assert ex.execute_batch(batch).token_ids[0] >= 0
    # 300 token counts reach oneDNN as 50 row counts (the lm_head sees one row per step).
    assert set(seen) == {row_bucket(n) for n in token_counts}
    assert len(set(seen)) == 50
