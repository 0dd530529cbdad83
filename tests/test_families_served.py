"""The families beyond Llama served by the real services (Redis, scheduler and executor processes,
a gateway, the `openai` client): greedy tokens equal transformers' on the same checkpoint.

One family of each kind the engine adds: interleaved sliding windows with Gemma's norms (Gemma 3),
a mixture of experts (Qwen3-MoE), and experts with biases plus attention sinks and windows
(gpt-oss). The offline parity tests (`test_model_families.py`, `test_moe_models.py`) cover chunked
prefill, preemption and tensor parallel; this checks the executor service loads and runs them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from infra.stack import Stack

pytestmark = [pytest.mark.stack, pytest.mark.model]

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe", "gpt_oss"])
def served(request: pytest.FixtureRequest, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    arch = request.param
    stack = Stack(tiny_model(arch), Path(tmp_path_factory.mktemp(f"served-{arch}")), executor_args=("--num-blocks", "128"))
    stack.start()
    yield stack
    stack.stop()


def hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_match_transformers(served: Stack) -> None:
    """Prompts longer than the tiny checkpoints' windows (16 tokens), batched by the engine; each
    answer's token ids are transformers' greedy continuation."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 23, 41)]
    with openai.OpenAI(base_url=f"{served.urls[0]}/v1", api_key="x", max_retries=0, timeout=120) as client:
        out = client.completions.create(
            model="",
            prompt=prompts,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    got = {c.index: (c.model_extra or {})["token_ids"] for c in out.choices}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(served.model, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(hf, prompt), f"prompt {i} ({len(prompt)} tokens) diverged"
