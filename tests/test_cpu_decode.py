"""The CPU decode kernel (`executor.cpu_decode`): its matrix-vector product against torch, decode
steps of one to eight rows against the torch path (greedy tokens and logprobs, across the families
it covers), and the fallbacks: a model it does not cover, no C compiler, ``cpu_decode_kernel="off"``."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from common import SamplingParams
from common.config import ModelConfig
from executor import cpu_decode
from executor.cpu_decode import CpuDecodeKernel, build_library
from gateway.llm import LLM

pytestmark = pytest.mark.model

ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=16, num_blocks=128, max_num_seqs=12)


@pytest.fixture(scope="module")
def lib() -> Any:
    """The built kernel library; the test is skipped where it cannot be built (no C compiler)."""
    built = build_library()
    if isinstance(built, str):
        pytest.skip(f"no kernel here: {built}")
    return built


@pytest.mark.parametrize("rows", range(1, 9))
def test_linear_matches_torch(lib: Any, rows: int) -> None:
    """Sizes whose rows fill panels partly, whole or in part of a group of them, with and without
    a bias, for every row count the kernel takes."""
    g = torch.Generator().manual_seed(rows)
    for n, k, bias in ((37, 100, True), (64, 48, False), (8, 17, True), (130, 16, False)):
        w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        y = torch.full((rows, n), float("nan"))
        ptr = cpu_decode._ptr
        assert lib.conveyor_linear(ptr(cpu_decode.panels(lib, w)), ptr(b), ptr(x), ptr(y), rows, n, k, 2) == 0
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert lib.conveyor_linear(None, None, None, None, 9, 1, 1, 1) != 0  # more rows than it takes


def _workload(vocab: int, n: int = 10) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` prompts of different lengths and output lengths, so decode steps shrink from ``n``
    rows (the torch path) through eight and fewer (the kernel's) as requests finish."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=3) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_decode_steps_match_the_torch_path(lib: Any, tiny_model, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Greedy tokens equal the torch path's and the logprobs agree, for plain Llama, QKV biases
    (Qwen2), q/k norms (Qwen3) and partial rotary (Phi-3); the kernel ran steps of 1 to 8 rows."""
    path = tiny_model(arch)
    rows_seen: set[int] = set()
    run = CpuDecodeKernel.run

    def counted(self: CpuDecodeKernel, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, head: bool = True) -> Any:
        hidden = run(self, input_ids, positions, meta, head)
        if hidden is not None:
            rows_seen.add(hidden.shape[0])
        return hidden

    monkeypatch.setattr(CpuDecodeKernel, "run", counted)
    on = LLM(path, cpu_decode_kernel="auto", **ENGINE)
    assert on.executor.cpu_decode is not None
    prompts, params = _workload(on.executor.info.vocab_size)
    got = on.generate(prompts, params)
    assert rows_seen == set(range(1, 9)), rows_seen
    off = LLM(path, cpu_decode_kernel="off", **ENGINE)
    assert off.executor.cpu_decode is None
    want = off.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t] - lb[t]) < 1e-4, (t, la[t], lb[t])


@pytest.mark.parametrize(
    ("arch", "why"), [("gemma3", "KV-cache groups"), ("mixtral", "dense MLP"), ("mistral", "sliding_window")]
)
def test_models_it_does_not_cover_run_in_torch(tiny_model, caplog: pytest.LogCaptureFixture, arch: str, why: str) -> None:
    path = tiny_model(arch, sliding_window=12) if arch == "mistral" else tiny_model(arch)
    with caplog.at_level(logging.INFO, logger="executor.cpu_decode"):
        llm = LLM(path, **ENGINE)
    assert llm.executor.cpu_decode is None
    assert any("cpu decode kernel off" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3


def test_no_compiler_or_off_runs_in_torch(tiny_model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_model("llama")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger="executor.cpu_decode"):
        llm = LLM(path, **ENGINE)
    assert llm.executor.cpu_decode is None
    assert "no C compiler (/nonexistent/cc)" in caplog.text
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3
    monkeypatch.delenv("CC")
    assert LLM(path, cpu_decode_kernel="off", **ENGINE).executor.cpu_decode is None


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="cpu_decode_kernel must be one of auto, off"):
        ModelConfig("m", cpu_decode_kernel="on").validate()
