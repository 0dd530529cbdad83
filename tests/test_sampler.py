"""Sampler: greedy, filters (checked statistically against the target distribution), seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from executor.sampler import Sampler

pytestmark = pytest.mark.unit

LOGITS = [2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]
DRAWS = 20_000


def target(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    """The distribution each filter combination should sample from, computed independently."""
    w = [math.exp(x / temperature) for x in LOGITS]
    z = sum(w)
    probs = [x / z for x in w]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    kept_mass = sum(probs[i] for i in keep)
    nucleus: set[int] = set()
    acc = 0.0
    for i in order:
        if i not in keep:
            continue
        if acc >= top_p:
            break
        nucleus.add(i)
        acc += probs[i] / kept_mass
    pmax = max(probs)
    final = [probs[i] if i in nucleus and probs[i] >= min_p * pmax else 0.0 for i in range(len(probs))]
    z = sum(final)
    return [x / z for x in final]


def frequencies(tokens: list[int]) -> list[float]:
    counts = [0] * len(LOGITS)
    for t in tokens:
        counts[t] += 1
    return [c / len(tokens) for c in counts]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=2.0),
        dict(top_k=3),
        dict(top_p=0.6),
        dict(min_p=0.2),
        dict(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1),
    ],
)
def test_filters_sample_the_target_distribution(kw: dict) -> None:
    sampler = Sampler(seed=123)
    logits = torch.tensor(LOGITS).repeat(DRAWS, 1)
    params = [SamplingParams(**kw)] * DRAWS
    tokens, lps = sampler.sample(logits, params, [0] * DRAWS)
    assert lps == [None] * DRAWS
    got, want = frequencies(tokens), target(**kw)
    # Filtered-out tokens never appear; kept ones match in total variation distance.
    assert all(g == 0.0 for g, w in zip(got, want) if w == 0.0)
    tv = 0.5 * sum(abs(g - w) for g, w in zip(got, want))
    assert tv < 0.015, (kw, got, want)


def test_seeded_rows_follow_the_distribution_too() -> None:
    """Per-request generators (different seeds) also draw from the right distribution."""
    n = 5000
    logits = torch.tensor(LOGITS).repeat(n, 1)
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    tokens, _ = Sampler().sample(logits, params, [3] * n)
    tv = 0.5 * sum(abs(g - w) for g, w in zip(frequencies(tokens), target(temperature=0.8)))
    assert tv < 0.03


def test_top_k_one_is_greedy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=g)
    greedy = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=1)
    assert sampler.sample(logits, [SamplingParams(top_k=1, temperature=1.5)] * 32, [0] * 32)[0] == greedy
    assert sampler.sample(logits, [SamplingParams(temperature=0.0)] * 32, [0] * 32)[0] == greedy
    # Mixed with random rows: the greedy rows are still argmax.
    mixed = [SamplingParams(top_k=1) if i % 2 else SamplingParams(temperature=1.0) for i in range(32)]
    tokens, _ = sampler.sample(logits, mixed, [0] * 32)
    assert [t for i, t in enumerate(tokens) if i % 2] == greedy[1::2]


def test_seed_reproducible_regardless_of_batch_mates() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 50
    row = torch.randn(vocab, generator=g)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    runs = []
    for batch_size, position in [(1, 0), (7, 3), (16, 15)]:
        logits = torch.randn(batch_size, vocab, generator=g)
        logits[position] = row
        params = [SamplingParams(temperature=1.0) for _ in range(batch_size)]
        params[position] = sp
        seq = []
        for step in range(20):
            tokens, _ = Sampler(seed=step + batch_size).sample(logits, params, [step] * batch_size)
            seq.append(tokens[position])
        runs.append(seq)
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 1  # different steps draw different noise
    other = [Sampler().sample(row[None], [SamplingParams(temperature=1.0, top_p=0.95, seed=43)], [s])[0][0] for s in range(20)]
    assert other != runs[0]


def test_logprobs_contents() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g) * 3
    ref = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.3, logprobs=0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, logprobs=5, seed=1),
    ]
    tokens, lps = Sampler().sample(logits, params, [0, 0, 0, 0])
    assert lps[2] is None
    # Sampled token plus the top-N, valued from the raw logits (temperature does not apply).
    assert list(lps[0]) == ref[0].topk(3).indices.tolist()  # greedy token is the top one
    assert lps[1].keys() == {tokens[1]}
    top5 = set(ref[3].topk(5).indices.tolist())
    assert set(lps[3]) == top5 | {tokens[3]}
    for i in (0, 1, 3):
        for t, v in lps[i].items():
            assert v == pytest.approx(float(ref[i, t]), abs=1e-6)


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    for seed in range(20):
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=seed)]
        tokens, _ = Sampler().sample(logits, params, [0, 0], banned=[[0], [0, 1]])
        assert tokens == [1, 2]


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 5e-324, 1e-20, 9.9e-6])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    """Below GREEDY_TEMPERATURE a row takes the argmax (1e-40 must not overflow and pick token 0)."""
    assert temperature < GREEDY_TEMPERATURE
    params = SamplingParams(temperature=temperature, seed=None)
    params.validate()
    assert params.greedy
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g) * 5
    logits[:, 0] = -50.0  # token 0 (what an overflow picks) is never the argmax
    want = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=3)
    assert sampler.sample(logits, [params] * 16, [0] * 16)[0] == want
    # In a batch with random rows (the per-row temperature path), still the argmax.
    mixed = [params if i % 2 else SamplingParams(temperature=1.0, seed=i) for i in range(16)]
    for step in range(5):
        tokens, _ = sampler.sample(logits, mixed, [step] * 16)
        assert tokens[1::2] == want[1::2]


def test_greedy_threshold_boundary() -> None:
    """At GREEDY_TEMPERATURE itself sampling is random in principle, but finite and all but one-hot."""
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert SamplingParams(temperature=1.0, top_k=1).greedy
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=g) * 30  # large logits: logits / 1e-5 ~ 1e7, finite in fp32
    want = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=GREEDY_TEMPERATURE, seed=s) for s in range(8)]
    assert Sampler().sample(logits, params, [0] * 8)[0] == want


def test_allowed_token_ids_are_the_only_tokens_sampled() -> None:
    """Rows with ``allowed_token_ids`` draw from those alone, renormalised; the others are untouched,
    and logprobs stay those of the raw logits."""
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    allowed = [torch.tensor([3, 7]), None, torch.tensor([9])]
    seen: set[int] = set()
    for seed in range(200):
        params = [SamplingParams(temperature=1.0, seed=seed, logprobs=1), SamplingParams(temperature=0.0), SamplingParams()]
        tokens, lps = Sampler().sample(logits, params, [0, 0, 0], allowed=allowed)
        assert tokens[0] in (3, 7) and tokens[1:] == [0, 9]
        seen.add(tokens[0])
        raw = torch.log_softmax(logits[0], -1)
        assert lps[0] is not None and lps[0][tokens[0]] == pytest.approx(float(raw[tokens[0]]), abs=1e-6)
    assert seen == {3, 7}
    greedy = [SamplingParams(temperature=0.0)] * 3
    assert Sampler().sample(logits, greedy, [0, 0, 0], allowed=allowed)[0] == [3, 0, 9]


def test_a_row_whose_bans_take_every_token_left_draws_as_if_unbanned() -> None:
    logits = torch.tensor([LOGITS, LOGITS])
    allowed = [torch.tensor([3, 7]), None]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    # Row 0: both allowed tokens banned -> its bans are lifted; row 1 keeps its ban.
    tokens, _ = Sampler().sample(logits, params, [0, 0], banned=[[3, 7], [0]], allowed=allowed)
    assert tokens == [3, 1]
    assert Sampler().sample(logits, params, [0, 0], banned=[[3], [0]], allowed=allowed)[0] == [7, 1]
