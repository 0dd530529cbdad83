"""Prompt-token ranks on the wire (`PromptLogprob`, the ``plp_ranks`` columns) and vLLM's
``prompt_logprobs`` field built from them."""

from __future__ import annotations

import pytest

from common.codec import PromptLogprob, pack_prompt_logprobs, rank_of, unpack_prompt_logprobs
from common.protocol import StepOutputs, StepResult, decode, encode
from gateway.output.prompt_logprobs import vllm_prompt_logprobs

pytestmark = pytest.mark.unit

ROWS = [[PromptLogprob({5: -3.0, 1: -0.5, 2: -1.0}, 7), PromptLogprob({2: -0.1, 1: -2.5}, 1)], None]


def test_ranks_survive_a_step_result_and_a_step_outputs_message() -> None:
    num, counts, ids, values, ranks = pack_prompt_logprobs(ROWS)
    assert ranks == [7, 1]
    result = StepResult(1, 2, [9, 9], plp_num=num, plp_counts=counts, plp_token_ids=ids, plp_values=values, plp_ranks=ranks)
    back = decode(encode(result))
    rows = unpack_prompt_logprobs(2, back.plp_num, back.plp_counts, back.plp_token_ids, back.plp_values, back.plp_ranks)
    assert rows == ROWS and [rank_of(e) for e in rows[0] or []] == [7, 1]
    out = StepOutputs()
    out.add("a", 0, [9], None, prompt_logprobs=[None, *ROWS[0]])
    plp = decode(encode(out.sealed())).prompt_logprobs()[0]
    assert plp == [None, *ROWS[0]] and [rank_of(e) for e in plp] == [0, 7, 1]
    with pytest.raises(Exception, match="disagree"):  # a rank column of another length
        unpack_prompt_logprobs(2, num, counts, ids, values, [7])


def test_vllms_field_names_each_position_with_ranks() -> None:
    entries = [None, *ROWS[0]]
    field = vllm_prompt_logprobs([4, 5, 2], entries, 1, lambda t: f"<{t}>")
    assert field[0] is None
    # Position 1: the prompt token 5 is 7th; the top 1 is token 1.
    assert field[1] == {
        "5": {"logprob": -3.0, "rank": 7, "decoded_token": "<5>"},
        "1": {"logprob": -0.5, "rank": 1, "decoded_token": "<1>"},
    }
    # Position 2: the prompt token is the top one: one entry.
    assert field[2] == {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "<2>"}}
