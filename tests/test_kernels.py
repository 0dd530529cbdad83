"""Triton kernels against their torch references, and the engine end to end on Triton ops.

Each case runs in its own process (``python -m tests.kernel_cases <case>``): without a GPU Triton's
interpreter has to be selected before any kernel is defined, and an out-of-bounds access under the
interpreter can crash the process instead of failing an assertion. With a GPU the same cases run
compiled on CUDA and add bf16 and longer sequences (bench/device_check.sh runs them there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
KERNEL_CASES = [
    "attn_4_4",
    "attn_8_2",
    "attn_5_1",
    "decode_split",
    "graph_split",
    "engine_shapes",
    "huge_pool",
    "norm_act",
    "rotary",
]


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_case(case: str, extra_env: dict[str, str] | None = None, timeout: int = 300, module: str = "tests.kernel_cases") -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if _on_gpu():
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, "-m", module, case],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        # A negative code is a signal: a crash in the interpreter, e.g. an out-of-bounds access.
        pytest.fail(
            f"case {case} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    assert f"OK {case}" in proc.stdout


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_reference(case: str) -> None:
    """Kernel output (NaN-poisoned first) equals the torch reference within dtype tolerances.

    attn_*: KV write by slot mapping, then paged attention over mixed prefill/decode batches
    (lengths 1..600, GQA 4/4, 8/2, 5/1, head sizes 64/80/128, block sizes 16/32).
    Mixed batches run their one-token rows on the decode tile and their chunks on the prefill
    tile, each launch over exactly the programs with work.
    decode_split: split-KV decode with 1, 3 and 16 splits (empty splits included).
    graph_split: a padded decode batch in the CUDA graphs' buffers with the split count a capture
    at a long max context picks, against the unpadded 2D kernel.
    engine_shapes: the GPU check's heads (32/8 of 64 mixed; 32/8 of 128 decode, split-KV too).
    huge_pool: block ids past 2^31 elements (int64 offsets) in the write and the attention.
    norm_act / rotary: RMSNorm with and without residual, SiLU- and GELU(tanh)-and-mul, neox
    rotary in place.
    """
    _run_case(case)


@pytest.mark.skipif(_on_gpu(), reason="on a GPU every kernel is compiled by the cases above")
def test_kernels_compile_for_sm90() -> None:
    """Each kernel at the configs the wrappers pick, built for sm_90 with the GPU JIT's
    specialisation (tests/sm90_build.py), has no spills and pipelines its attention loads.

    The interpreter never runs the real compiler, so this also catches code it would reject.
    """
    _run_case("compile_sm90", {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"})


def test_engine_triton_matches_torch(tiny_model: Callable[..., Path]) -> None:
    """The engine gives the same greedy tokens with attention_backend triton as with torch."""
    model = tiny_model("llama")
    _run_case("e2e", {"CONVEYOR_TEST_MODEL": str(model)}, timeout=600)
