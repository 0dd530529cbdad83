"""Prepacked CPU linear layers equal a plain matmul; the offline benchmark runs end to end."""

from __future__ import annotations

import torch

from executor.layers.linear import Linear


def test_packed_linear_matches_plain_matmul() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(2100, 96), torch.randn(2100)
    for b in (None, bias):
        layer = Linear(weight, b)
        assert layer.packed is not None or not torch.backends.mkldnn.is_available()
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    half = Linear(weight.half(), bias.half())
    assert half.packed is None  # only fp32 is packed
    torch.testing.assert_close(
        half(torch.ones(2, 96).half()), torch.nn.functional.linear(torch.ones(2, 96).half(), weight.half(), bias.half())
    )


def test_offline_bench_runs(tiny_model, capsys) -> None:
    from bench.offline import main

    assert main(["--model", str(tiny_model("llama")), "--workload", "all", "--limit", "3"]) == 0
    table = capsys.readouterr().out
    assert "| uniform | 3 |" in table and "| mixed | 3 |" in table
    assert table.count("x |") == 2  # a ratio per workload
