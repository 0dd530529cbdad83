"""vLLM's ``prompt_logprobs`` over HTTP (the real stack, the `openai` client): per prompt position
the prompt token's logprob and rank in the vocabulary and the top-k, with transformers on the same
checkpoint as the oracle; on completions' choices and on a chat response."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from infra.stack import Stack

pytestmark = pytest.mark.stack

NO_EOS = {"ignore_eos": True}
K = 3


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model(), Path(tmp_path_factory.mktemp("plp")))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _oracle(model: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position (row p predicts token p + 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


def _check(plp: list[Any], prompt: list[int], want: torch.Tensor, k: int) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    ranks_seen = set()
    for pos in range(1, len(prompt)):
        row, token = want[pos - 1], prompt[pos]
        entry = plp[pos]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
        rank = int((row > row[token]).sum().item()) + 1
        assert abs(mine["rank"] - rank) <= 1 if rank > 1 else mine["rank"] == 1  # (float ties at the edge)
        assert isinstance(mine["decoded_token"], str)
        ranks_seen.add(mine["rank"])
        top = row.topk(k)
        for place, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[str(tid)]["logprob"] == pytest.approx(value, abs=1e-3) and entry[str(tid)]["rank"] == place
        assert len(entry) in (k, k + 1)  # the top k, and the prompt token unless among them
    assert any(r > K for r in ranks_seen), "a random prompt has tokens outside the top k: their ranks say where"


def test_completions_return_vllms_prompt_logprobs(stack: Stack, client: openai.OpenAI) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 200) for _ in range(17)]
    out = client.completions.create(
        model="", prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": K, **NO_EOS}
    )
    plp = out.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    _check(plp, prompt, _oracle(stack.model, prompt), K)
    # With echo and logprobs too, each keeps its own top-k.
    both = client.completions.create(
        model="", prompt=prompt, echo=True, logprobs=5, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1, **NO_EOS}
    )
    _check(both.choices[0].model_extra["prompt_logprobs"], prompt, _oracle(stack.model, prompt), 1)  # type: ignore[index]
    assert both.choices[0].logprobs is not None and len(both.choices[0].logprobs.top_logprobs[1]) >= 5  # type: ignore[index]


def test_chat_returns_them_on_the_response(stack: Stack, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "count: one two three"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 2, "return_token_ids": True, **NO_EOS},
    )
    extra = out.model_extra or {}
    prompt = extra["prompt_token_ids"]
    _check(extra["prompt_logprobs"], prompt, _oracle(stack.model, prompt), 2)
    assert "prompt_logprobs" not in (out.choices[0].model_extra or {})


def test_prompt_logprobs_are_refused_when_streamed_or_out_of_range(client: openai.OpenAI) -> None:
    for extra in ({"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": 10**6}, {"prompt_logprobs": "2"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="", prompt="hi", max_tokens=2, extra_body=extra)
        assert "prompt_logprobs" in str(info.value)
