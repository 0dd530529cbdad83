"""Row-chunked CPU linear layers equal one matmul; the offline benchmark runs end to end."""

from __future__ import annotations

import torch

from executor.model import CPU_LINEAR_CHUNK, Linear


def test_chunked_linear_matches_single_matmul() -> None:
    torch.manual_seed(0)
    n = 2 * CPU_LINEAR_CHUNK + 100  # two full chunks and a ragged one
    weight, bias = torch.randn(n, 64), torch.randn(n)
    for b in (None, bias):
        layer = Linear(weight, b)
        assert layer.chunks is not None and len(layer.chunks) == 3
        for rows in (1, 7, 300):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    assert Linear(torch.randn(CPU_LINEAR_CHUNK, 64)).chunks is None  # narrow weights stay whole


def test_offline_bench_runs(tiny_model, capsys) -> None:
    from bench.offline import main

    assert main(["--model", str(tiny_model("llama")), "--workload", "all", "--limit", "3"]) == 0
    table = capsys.readouterr().out
    assert "| uniform | 3 |" in table and "| mixed | 3 |" in table
    assert table.count("x |") == 2  # a ratio per workload
