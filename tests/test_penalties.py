"""Logit bias and presence/frequency/repetition penalties: the math against a per-element
reference, the sampler's use of them, the executor's incremental token counts, validation and
the wire format."""

from __future__ import annotations

import random

import pytest
import torch

from common.protocol import SchedulerOutput, decode, encode
from common.sampling_params import SamplingParams, sampling_from_dict, sampling_to_dict
from common.structured_outputs import StructuredOutputsParams
from executor.input_batch import PersistentBatch
from executor.penalties import BadWords, TokenCountPool, TokenCounts, apply_logit_bias, apply_penalties
from executor.sampler import Sampler

pytestmark = pytest.mark.unit

VOCAB = 12


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], presence: float, frequency: float, repetition: float
) -> list[float]:
    """vLLM's penalties written out per token, for one row."""
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        x -= frequency * count + (presence if count else 0.0)
        out.append(x)
    return out


def test_penalties_match_the_reference() -> None:
    rng = random.Random(0)
    rows = [
        (0.0, 0.0, 1.3),  # repetition only
        (1.5, 0.0, 1.0),  # presence only
        (0.0, 0.7, 1.0),  # frequency only
        (-0.5, 2.0, 0.8),  # all, a negative presence and a repetition below 1 (a reward)
        (-2.0, -2.0, 2.0),
    ]
    logits = [[rng.uniform(-3, 3) for _ in range(VOCAB)] for _ in rows]
    logits[0][4] = 0.0  # a zero logit of a seen token stays zero
    logits[3][5] = float("-inf")  # a banned token stays banned
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] + [4] for _ in rows]
    outputs = [[rng.randrange(VOCAB) for _ in range(7)] + [5, 5] for _ in rows]
    mask = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
    counts = torch.zeros(len(rows), VOCAB, dtype=torch.int32)
    for i in range(len(rows)):
        mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    pres, freq, rep = (torch.tensor(c) for c in zip(*rows))
    got = apply_penalties(torch.tensor(logits), mask, counts, pres, freq, rep)
    for i, (p, f, r) in enumerate(rows):
        want = reference_penalties(logits[i], prompts[i], outputs[i], p, f, r)
        assert got[i].tolist() == pytest.approx(want, abs=1e-6)
    assert got[0, 4] == 0.0 and got[3, 5] == float("-inf")


def test_neutral_penalties_change_nothing() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    mask = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(2)) > 0.5
    counts = torch.randint(0, 3, (3, VOCAB), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    zeros, ones = torch.zeros(3), torch.ones(3)
    assert torch.equal(apply_penalties(logits, mask, counts, zeros, zeros, ones), logits)


def test_logit_bias_adds_to_its_rows_only() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logit_bias={2: 5.0, 7: -1.5}), SamplingParams(), SamplingParams(logit_bias={0: 100})]
    got = apply_logit_bias(logits, params)
    want = logits.clone()
    want[0, 2] += 5.0
    want[0, 7] -= 1.5
    want[2, 0] += 100
    assert torch.equal(got, want)
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits  # nothing to do: no work


def test_sampler_applies_bias_and_penalties_but_logprobs_stay_raw() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 4)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0, logit_bias={3: 3.5}, logprobs=1),  # 0.0 + 3.5 beats 3.0
        SamplingParams(temperature=0, presence_penalty=1.5, logprobs=1),  # token 0 was generated: 1.5 < 2.0
        SamplingParams(temperature=0, logprobs=1),  # untouched: argmax 0
        SamplingParams(temperature=0, repetition_penalty=4.0, logprobs=1),  # 0 in the prompt: 0.75 < 2.0
    ]
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 0] = True
    counts = torch.zeros(2, 4, dtype=torch.int32)
    counts[0, 0] = 1
    tokens, lps = Sampler().sample(logits, params, [0] * 4, counts=TokenCounts([1, 3], mask, counts))
    assert tokens == [3, 1, 0, 1]
    for i, t in enumerate(tokens):
        assert lps[i][t] == pytest.approx(float(raw[i, t]))  # logprobs of the model, not of the edits
    # A bias of -100 bans a token even at temperature 1, seeded or not; +100 forces one.
    for seed in (None, 1, 2):
        params = [
            SamplingParams(temperature=1.0, seed=seed, logit_bias={0: -100, 1: -100, 2: -100}),
            SamplingParams(temperature=1.0, seed=seed, logit_bias={2: 100}),
        ]
        assert Sampler(seed=5).sample(logits[:2], params, [3, 3])[0] == [3, 2]


def test_seeded_sampling_with_penalties_is_deterministic() -> None:
    """Penalties only edit the logits: a seeded row still draws the same token for the same
    (seed, position), whatever its batch mates."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(VOCAB, generator=g)
    mask = torch.rand(1, VOCAB, generator=g) > 0.5
    counts = torch.randint(0, 3, (1, VOCAB), dtype=torch.int32, generator=g)
    p = SamplingParams(temperature=1.0, seed=11, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    draws = []
    for n, where in ((1, 0), (5, 3)):
        logits = torch.randn(n, VOCAB, generator=g)
        logits[where] = row
        params = [SamplingParams(temperature=1.0)] * n
        params[where] = p
        draws.append(
            [
                Sampler(seed=n).sample(logits, params, [pos] * n, counts=TokenCounts([where], mask, counts))[0][where]
                for pos in range(30)
            ]
        )
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def _step(number: int) -> SchedulerOutput:
    return SchedulerOutput(step=number, epoch=1)


def test_token_counts_are_kept_incrementally_and_slots_reused() -> None:
    """The executor counts each token once (first use: the prompt and any output it was sent),
    and the pool rows equal a recount of each request's tokens at every step; a finished
    request's slot is reused, zeroed; requests without penalties get none, and a batch
    without any has no token-count work at all."""
    vocab, bs = 50, 4
    state = PersistentBatch(bs, vocab)
    pool = TokenCountPool(vocab, torch.device("cpu"))
    rng = random.Random(0)
    pen = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    plain = SamplingParams(logit_bias={3: 1.0})
    out = _step(1)
    out.add_new("plain", plain, 3, [1, 2, 3], [0, 10, 11, 12])
    out.add_scheduled("plain", 3, 0, True)
    batch = state.prepare(out)
    assert batch.token_counts is None  # no request with penalties: nothing to count
    state.append_sampled(batch, [7])
    # "a": prompt [4, 4, 9] plus 2 outputs it was sent (a migrated request); "b" joins in chunks.
    out = _step(2)
    out.add_new("a", pen, 3, [4, 4, 9, 9, 11], [1, 2, 13, 14])
    out.add_new("b", SamplingParams(presence_penalty=1.0), 6, [5, 6, 7, 8, 5, 6], [3, 4, 15, 16])
    out.add_scheduled("plain", 1, 3, True)
    out.add_scheduled("a", 5, 0, True)
    out.add_scheduled("b", 4, 0, False)  # a prefill chunk: b does not sample yet
    batch = state.prepare(out)
    batch.check()
    assert batch.token_counts is not None and batch.token_counts.slots == [-1, 0, -1]
    for step_number in range(3, 9):
        assert batch.token_counts is not None
        pool.update(batch.token_counts)
        for i, request_id in enumerate(batch.request_ids):
            slot = batch.token_counts.slots[i]
            if slot < 0:
                continue
            r = state.requests[request_id]
            prompt, output = r.token_ids[: r.num_prompt_tokens], r.token_ids[r.num_prompt_tokens :]
            want_counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab)
            assert pool.output_counts[slot].tolist() == want_counts.tolist()
            marked = set(prompt) if r.params.repetition_penalty != 1.0 else set()
            assert set(pool.prompt_mask[slot].nonzero().flatten().tolist()) == marked
        state.append_sampled(batch, [rng.randrange(vocab) if s else -1 for s in batch.sample])
        out = _step(step_number)
        held = [r for r in ("plain", "a", "b", "c") if r in state.requests]
        if step_number == 5:
            out.finished_req_ids.append("a")  # its slot 0 is freed, and reused by "c"
            held.remove("a")
            out.add_new("c", pen, 2, [30, 31], [20, 21, 22, 23])
            held.append("c")
        for r in held:
            if r == "b" and step_number == 3:
                out.add_scheduled("b", 2, 4, True)  # the rest of b's prompt
            elif r == "c" and step_number == 5:
                out.add_scheduled("c", 2, 0, True)
            else:
                out.add_scheduled(r, 1, len(state.requests[r].token_ids) - 1, True)
        batch = state.prepare(out)
        batch.check()
        if step_number == 5:
            assert batch.token_counts is not None
            assert batch.token_counts.slots[batch.request_ids.index("c")] == 0 and 0 in batch.token_counts.reset
    assert state.num_slots == 2  # a (then c) and b
    state.clear()
    pool.clear()
    assert state.num_slots == 0 and pool.output_counts.shape[0] == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty="1"), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=1e-3), "repetition_penalty"),  # float32 logits divided by it overflow
        (dict(repetition_penalty=101), "repetition_penalty"),
        (dict(logit_bias={5: 100.5}), "logit_bias values"),
        (dict(logit_bias={5: float("nan")}), "logit_bias values"),
        (dict(logit_bias={"5": 1.0}), "logit_bias token ids"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token ids"),
        (dict(logit_bias={True: 1.0}), "logit_bias token ids"),
        (dict(logit_bias={VOCAB: 1.0}), rf"logit_bias token ids must be in \[0, {VOCAB}\) \(the vocabulary\), got \[{VOCAB}\]"),
        (dict(logit_bias=[(1, 2.0)]), "logit_bias must be a map"),
        (dict(logit_bias={i: 1.0 for i in range(SamplingParams.MAX_LOGIT_BIAS + 1)}), "at most"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a list of 1 to"),
        (dict(allowed_token_ids=list(range(SamplingParams.MAX_ALLOWED_TOKEN_IDS + 1))), "allowed_token_ids must be a list"),
        (dict(allowed_token_ids=[1, -1]), "allowed_token_ids must be integers"),
        (dict(allowed_token_ids=[1, True]), "allowed_token_ids must be integers"),
        (dict(allowed_token_ids=[VOCAB]), rf"allowed_token_ids must be in \[0, {VOCAB}\)"),
        (
            dict(allowed_token_ids=[1], structured_outputs=StructuredOutputsParams(regex="a")),
            "allowed_token_ids cannot be combined with structured outputs",
        ),
    ],
)
def test_validation(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate(VOCAB)


def test_boundary_values_are_valid() -> None:
    for kw in (
        dict(presence_penalty=-2, frequency_penalty=2.0),
        dict(repetition_penalty=0.01),
        dict(repetition_penalty=100),
        dict(logit_bias={0: -100, VOCAB - 1: 100.0}),
        dict(logit_bias={}),
    ):
        SamplingParams(**kw).validate(VOCAB)
    assert not SamplingParams(logit_bias={1: 5.0}).penalized
    assert SamplingParams(repetition_penalty=1.1).penalized and SamplingParams(frequency_penalty=-0.1).penalized


def test_wire_round_trip() -> None:
    """``logit_bias`` crosses msgpack (whose map keys must be strings here) as pairs."""
    p = SamplingParams(
        temperature=0.5,
        presence_penalty=0.25,
        frequency_penalty=-1.0,
        repetition_penalty=1.3,
        logit_bias={7: -100, 2**31 - 1: 2.5},
        allowed_token_ids=[3, 5, 8],
    )
    out = SchedulerOutput(step=1, epoch=1)
    out.add_new("r", p, 1, [1], [0])
    wire = decode(encode(out), (SchedulerOutput,))
    assert sampling_from_dict(wire.new_requests()[0].sampling) == p
    assert sampling_from_dict(sampling_to_dict(SamplingParams())) == SamplingParams()
    with pytest.raises(ValueError, match="pairs"):
        sampling_from_dict({"logit_bias": [[1, 2, 3]]})


def test_bad_word_bans_follow_the_output_tail() -> None:
    bad = BadWords([[9], [4, 5], [1, 2, 3], [7, 8], [5, 2, 4]])
    prompt_then_output = [4, 1, 2, 6, 1, 2]  # the last 3 are the output
    # [9] always; [4, 5] not: its 4 is in the prompt; [1, 2, 3]: the output ends with 1, 2; not
    # [5, 2, 4] (indexed under 2 too).
    assert bad.bans(prompt_then_output, 3) == [9, 3]
    assert bad.bans(prompt_then_output, 1) == [9]  # 1, 2 are not both output
    assert bad.bans([4], 0) == [9]
    assert bad.bans([6, 4], 1) == [9, 5]
