"""The kernels of the model families beyond Llama against plain torch references: paged attention
with sliding windows, sinks and soft-capping (tests/attention_variant_cases.py) and fused MoE
(tests/fused_moe_cases.py). Each case runs in its own process, as in tests/test_kernels.py.
"""

from __future__ import annotations

import pytest

from tests.test_kernels import _run_case

pytestmark = pytest.mark.model

ATTENTION_CASES = ["window_mixed", "sinks_softcap_mixed", "window_decode_split"]
MOE_CASES = ["align", "fused_moe", "fused_moe_wide"]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_paged_attention_variant_matches_reference(case: str) -> None:
    """NaN-poisoned outputs and out-of-window keys; 2D, split-KV and the dispatcher vs the torch
    reference. window_mixed: windows 1, 16, 40 (across blocks of 16), past the context; GQA 8/2
    and 4/4 over mixed prefill/decode batches. sinks_softcap_mixed: sinks, soft-capping, both with
    a window, GQA 5/1. window_decode_split: 1, 3 and 16 splits of the window, sinks in one split."""
    _run_case(case, module="tests.attention_variant_cases")


@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_moe_matches_reference(case: str) -> None:
    """align: moe_align_block_size groups every assignment once, by expert, padded to BLOCK_M.
    fused_moe: T 1/3/17/64, E 4/8, k 1/2, both activations, biases, sizes off the tiles (fp32).
    fused_moe_wide: fp16, 16 experts for 3 tokens (empty blocks), clamps of swigluoai hit."""
    _run_case(case, module="tests.fused_moe_cases")
