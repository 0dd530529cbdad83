"""Offline and served outputs agree: `LLM.generate` and the gateway's `Generation` run the same
output processor, so the same tokens give the same text, finish_reason and stop_reason (stop
strings, stop token ids, include_stop_str_in_output) on both sides."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from common.sampling_params import SamplingParams, sampling_to_dict
from gateway.engine.handle import EngineEvent, RequestHandle
from gateway.llm import LLM
from gateway.output.generation import Generation, SequenceRequest

pytestmark = pytest.mark.model

PROMPT = "def hello(world):"
MAX_TOKENS = 24


class _Client:
    """What `Generation` asks of its engine client once submitted."""

    gateway_id = "g"

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release(self, request_id: str) -> None:
        pass


def _served(
    tokenizer: Any, params: SamplingParams, token_ids: list[int], finish_reason: str, stop_reason: int | None, per_event: int
) -> tuple[str, list[int], str | None, int | str | None]:
    """What the gateway makes of an engine that produced ``token_ids`` (``per_event`` a time) and
    then ended with ``finish_reason``: (text, the client's tokens, finish_reason, stop_reason)."""

    async def run() -> tuple[str, list[int], str | None, int | str | None]:
        gen = Generation(_Client(), tokenizer, SequenceRequest("r", [1], params))  # type: ignore[arg-type]
        gen.handle = RequestHandle("r", [1], {})
        for i in range(0, len(token_ids), per_event):
            chunk = token_ids[i : i + per_event]
            last = i + per_event >= len(token_ids)
            event = EngineEvent(chunk, [None] * len(chunk), last, finish_reason if last else None, stop_reason=stop_reason)
            gen.handle.events.put_nowait(event)
        text, tokens, reason, why = "", [], None, None
        async for piece in gen.pieces():
            text += piece.text
            tokens += piece.token_ids
            reason, why = piece.finish_reason, piece.stop_reason
        return text, tokens, reason, why

    return asyncio.run(run())


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(tiny_model("llama"), dtype="float32", block_size=16, max_num_batched_tokens=64, max_num_seqs=4)


def test_offline_generation_honours_stop_strings_as_the_server_does(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [full] = llm.generate(PROMPT, greedy)
    assert full.finish_reason == "length" and len(full.token_ids) == MAX_TOKENS
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text  # (a visible stop string, past the first tokens)
    params = dataclasses.replace(greedy, stop=[stop])
    [out] = llm.generate(PROMPT, params)
    assert out.text == full.text[: full.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < MAX_TOKENS and out.token_ids == full.token_ids[: len(out.token_ids)]
    for per_event in (1, 3, MAX_TOKENS):  # however the gateway's reads group the engine's steps
        served = _served(llm.tokenizer, params, full.token_ids, "length", None, per_event)
        assert served == (out.text, out.token_ids, out.finish_reason, out.stop_reason), per_event
    kept = dataclasses.replace(params, include_stop_str_in_output=True)
    [with_stop] = llm.generate(PROMPT, kept)
    assert with_stop.text == out.text + stop
    assert _served(llm.tokenizer, kept, full.token_ids, "length", None, 1)[0] == with_stop.text


def test_the_stop_token_rule_is_the_same_offline_and_served(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [full] = llm.generate(PROMPT, greedy)
    stop_id = full.token_ids[MAX_TOKENS // 2]
    for include in (False, True):
        params = dataclasses.replace(greedy, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        [out] = llm.generate(PROMPT, params)
        assert (out.finish_reason, out.stop_reason) == ("stop", stop_id) and out.token_ids[-1] == stop_id
        shown = out.token_ids if include else out.token_ids[:-1]  # its text only when asked for
        assert out.text == llm.tokenizer.decode(shown, skip_special_tokens=True)
        served = _served(llm.tokenizer, params, out.token_ids, "stop", stop_id, 2)
        assert served == (out.text, out.token_ids, "stop", stop_id)


def test_output_fields_stay_off_the_wire() -> None:
    """Stop strings are the frontend's: the engine's copy of the parameters does not carry them."""
    wire = sampling_to_dict(SamplingParams(stop=["x"], include_stop_str_in_output=True, skip_special_tokens=False))
    assert not {"stop", "include_stop_str_in_output", "skip_special_tokens"} & wire.keys()
    with pytest.raises(ValueError, match="^stop "):
        SamplingParams(stop=[""]).validate()
