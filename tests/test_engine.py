"""The offline engine end to end on real tiny checkpoints, with transformers as the oracle."""

from __future__ import annotations

import random

import pytest
import torch

from common import SamplingParams
from gateway.llm import LLM

pytestmark = pytest.mark.model

PROMPT_LENS = [1, 2, 7, 16, 17, 33, 64, 100, 150, 320]
MAX_TOKENS = 10


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(hf, prompt: list[int], n: int, **kwargs) -> tuple[list[int], torch.Tensor]:
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
        **kwargs,
    )
    logprobs = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1)
    return out.sequences[0, len(prompt) :].tolist(), logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_with_transformers(tiny_model, arch: str) -> None:
    model_dir = tiny_model(arch)
    # A small token budget forces chunked prefills to share steps with decodes.
    llm = LLM(model_dir, dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=8)
    prompts = random_prompts(llm.executor.info.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    steps = llm.scheduler.num_steps
    assert steps > MAX_TOKENS + 5, "the budget should have split prefills across steps"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        want, hf_logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
        for step, lp in enumerate(out.logprobs):
            assert lp is not None and len(lp) >= 5
            for token, value in lp.items():
                assert abs(value - hf_logprobs[step, token].item()) < 1e-3
            top = torch.topk(hf_logprobs[step], 5).indices.tolist()
            assert set(top) <= set(lp)
    llm.cache_manager.check_invariants()


def test_repetition_penalty_parity_with_transformers(tiny_model) -> None:
    """Greedy with ``repetition_penalty=1.3`` (over prompt and output) is transformers' greedy
    with the same penalty; half the prompts run without it in the same batches (the penalised
    rows are a subset of the sampled ones) and match plain greedy."""
    model_dir = tiny_model("llama")
    llm = LLM(model_dir, dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=8)
    prompts = random_prompts(llm.executor.info.vocab_size, seed=3)
    n = 24
    penalised = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    params = [penalised if i % 2 == 0 else plain for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    unpenalised = llm.generate(prompts[::2], plain)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        want, _ = hf_greedy(hf, prompt, n, **({"repetition_penalty": 1.3} if i % 2 == 0 else {}))
        assert out.token_ids == want, f"prompt {i} ({len(prompt)} tokens) diverged"
    assert any(a.token_ids != b.token_ids for a, b in zip(outputs[::2], unpenalised)), "the penalty changed nothing"
    llm.cache_manager.check_invariants()


def reference_penalised_greedy(hf, prompt: list[int], n: int, presence: float, frequency: float, repetition: float) -> list[int]:
    """Greedy decoding with vLLM's penalties applied by hand to transformers' logits, token by token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            for token in set(ids):  # repetition: prompt and output
                x = logits[token]
                logits[token] = x / repetition if x > 0 else x * repetition
            for token in set(out):  # presence and frequency: the output only
                logits[token] -= frequency * out.count(token) + presence
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_presence_and_frequency_penalties(tiny_model) -> None:
    """Presence and frequency penalties (and all three together) match a by-hand reference,
    change the output, and are deterministic, greedy and seeded."""
    model_dir = tiny_model("llama")
    llm = LLM(model_dir, dtype="float32", block_size=16, max_num_batched_tokens=48)
    prompts = random_prompts(llm.executor.info.vocab_size, seed=4)[:6]
    n = 16
    kinds = [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.2),
    ]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kinds[i % 3]) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, p, out in zip(prompts, params, outputs):
        want = reference_penalised_greedy(hf, prompt, n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        assert out.token_ids == want, p
    for kind in range(3):
        assert any(o.token_ids != q.token_ids for o, q in zip(outputs[kind::3], plain[kind::3])), kinds[kind]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in outputs]
    seeded = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5)
        for i in range(len(prompts))
    ]
    first = [o.token_ids for o in llm.generate(prompts, seeded)]
    alone = llm.generate(prompts[2], seeded[2])[0].token_ids
    assert first == [o.token_ids for o in llm.generate(prompts, seeded)] and alone == first[2]
    unpenalised_seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i in range(len(prompts))]
    assert first != [o.token_ids for o in llm.generate(prompts, unpenalised_seeded)]
    assert llm.executor.input_batch.num_slots <= len(prompts)  # pool rows are reused across requests


@pytest.fixture(scope="module")
def llama(tiny_model) -> LLM:
    """One engine on the tiny llama for the tests that only generate (none changes its options)."""
    return LLM(tiny_model("llama"), block_size=16)


@pytest.fixture(scope="module")
def llama_512(tiny_model) -> LLM:
    """One engine with a 512-token context, shared by the bad-input cases."""
    return LLM(tiny_model("llama"), block_size=16, max_model_len=512)


def test_logit_bias_forces_and_bans_tokens(llama: LLM) -> None:
    llm = llama
    prompt = [5, 6, 7, 8]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    forced_token = next(t for t in range(100, 1000) if t not in base)
    for p in (
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={forced_token: 100}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logit_bias={forced_token: 100.0}),
    ):
        assert llm.generate([prompt], p)[0].token_ids == [forced_token] * 8
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={base[0]: -100}))[
        0
    ].token_ids
    assert base[0] not in banned and banned != base
    vocab = llm.executor.info.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\)"):
        llm.generate([prompt], SamplingParams(logit_bias={vocab: 1.0}))
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids == base


def test_text_prompts_and_mixed_params(llama: LLM) -> None:
    llm = llama
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["Hello world", "def f(x):"], [greedy, SamplingParams(temperature=0.8, seed=3, max_tokens=6)])
    assert outs[0].prompt == "Hello world"
    assert outs[0].prompt_token_ids == llm.tokenizer("Hello world")["input_ids"]
    assert len(outs[0].token_ids) == 6
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)
    assert 1 <= len(outs[1].token_ids) <= 6
    assert outs[0].logprobs is None


def test_preemption_gives_identical_outputs(tiny_model, caplog) -> None:
    model_dir = tiny_model("llama")
    prompts = random_prompts(1000, seed=1)[2:]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = LLM(model_dir, block_size=16, max_num_batched_tokens=128, num_blocks=256)
    want = big.generate(prompts, params)
    # 30 blocks = 480 tokens: enough for the longest request (344), far too few for all of them.
    small = LLM(model_dir, block_size=16, max_num_batched_tokens=128, num_blocks=30, max_model_len=480)
    got = small.generate(prompts, params)
    assert big.scheduler.num_preemptions == 0
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    small.cache_manager.check_invariants()
    assert small.cache_manager.get_num_free_blocks() == 30


def test_async_scheduling_gives_identical_outputs(tiny_model) -> None:
    """One step ahead vs one step at a time: same tokens and finish reasons, greedy and seeded,
    with preemptions, chunked prefills and stop tokens found one step late; the extra token a
    request computes after its stop is never reported, and the executor drops every finished
    request's state."""
    model_dir = tiny_model("llama")
    prompts = random_prompts(1000, seed=2)[:10]
    options = dict(block_size=16, max_num_batched_tokens=64, num_blocks=30, max_model_len=480)
    sync = LLM(model_dir, async_scheduling=False, **options)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True)
        for i in range(len(prompts))
    ]
    free_run = sync.generate(prompts, params)
    # Stop tokens taken from the middle of each free run: requests end early, at a known token.
    for p, out in zip(params, free_run):
        p.stop_token_ids = [out.token_ids[7]]
    want = sync.generate(prompts, params)
    three = LLM(model_dir, steps_in_flight=3, **options).generate(prompts, params)  # two ahead
    assert [(o.token_ids, o.finish_reason) for o in three] == [(o.token_ids, o.finish_reason) for o in want]
    got_async = LLM(model_dir, **options)
    got = got_async.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert all(o.finish_reason == "stop" and o.token_ids[-1] in p.stop_token_ids for o, p in zip(got, params))
    assert [o.stop_reason for o in got] == [o.token_ids[-1] for o in got]  # vLLM's stop_reason: the stop token
    # ... which is no text (vLLM's rule): the text is that of the tokens before it.
    assert [o.text for o in got] == [got_async.tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True) for o in got]
    assert all(o.stop_reason is None and o.finish_reason == "length" for o in free_run)
    assert sync.scheduler.num_preemptions > 0 and got_async.scheduler.num_preemptions > 0
    # Finished requests' state leaves the executor with the next step.
    held = set(got_async.executor.input_batch.requests)
    assert held <= set(got_async.scheduler.finished_for_executor)
    got_async.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert not held & set(got_async.executor.input_batch.requests)
    got_async.cache_manager.check_invariants()


def test_seeded_sampling_ignores_batch_mates(tiny_model) -> None:
    llm = LLM(tiny_model("qwen2"), block_size=16)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], p)[0].token_ids
    mates = [[9, 10, 11], [12] * 40, [5, 6, 7, 8]]
    crowd = llm.generate(mates + [[5, 6, 7, 8]], [SamplingParams(temperature=1.0, max_tokens=12)] * 3 + [p])
    assert crowd[-1].token_ids == alone
    top1 = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.7, top_k=1, max_tokens=12, ignore_eos=True))
    greedy = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert top1[0].token_ids == greedy[0].token_ids


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "at least one token"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(temperature=-1), "temperature"),
        ([1] * 600, SamplingParams(), "max_model_len"),
        ([10**9], SamplingParams(), "token ids"),
        ("hi", SamplingParams(presence_penalty=3), "presence_penalty"),
        ("hi", SamplingParams(repetition_penalty=0), "repetition_penalty"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        ("hi", SamplingParams(logit_bias={5: -101}), "logit_bias"),
    ],
)
def test_bad_input_raises_and_engine_stays_usable(llama_512: LLM, prompt, params, match) -> None:
    llm = llama_512
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], params)
    assert not llm.scheduler.has_unfinished()
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    llm.cache_manager.check_invariants()


@pytest.mark.parametrize("where", ["launch", "update_from_output"])
def test_an_interrupted_generate_leaves_the_llm_usable(tiny_model, where: str) -> None:
    """Ctrl-C in a notebook: inside a forward pass, or while a step's tokens are applied. The next
    ``generate`` runs as on a fresh engine (the step bookkeeping stays in step)."""
    llm = LLM(tiny_model("llama"), block_size=16)
    prompts = [[5, 17, 99, 3], [42] * 20, list(range(40, 73))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    owner = llm.executor if where == "launch" else llm.scheduler
    real, calls = getattr(owner, where), [0]

    def interrupted(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args)

    setattr(owner, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    setattr(owner, where, real)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert [o.token_ids for o in llm.generate(prompts[:1], params)] == want[:1]


def test_a_refused_prompt_leaves_none_of_its_batch_queued(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), block_size=16, max_model_len=256, max_step_bytes=8000)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=20)
    with pytest.raises(ValueError, match="prompt_logprobs=20 over a prompt of 100 tokens"):
        llm.generate([[5, 6, 7], list(range(3, 103))], params)  # the second's prompt logprobs: 25 KB
    assert not llm.scheduler.requests  # the first was not left to run in the next call
    assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4


def test_generate_without_parameters_samples_as_the_model_says(tiny_model, tmp_path) -> None:
    """vLLM's: ``generate(prompts)`` takes the model's generation config (here greedy, through
    ``top_k`` 1), not SamplingParams' temperature 1."""
    import json
    import shutil

    from common.generation_config import load_sampling_defaults

    model = tmp_path / "greedy-model"
    shutil.copytree(tiny_model(), model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1, "temperature": 0.7}))
    llm = LLM(str(model), dtype="float32", num_threads=1)
    assert (llm.get_default_sampling_params().top_k, llm.get_default_sampling_params().temperature) == (1, 0.7)
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16))[0].token_ids
    assert [o.token_ids for o in llm.generate([[5, 6, 7]] * 3)] == [greedy] * 3
    assert LLM(str(model), dtype="float32", num_threads=1, generation_config="vllm").get_default_sampling_params().top_k == 0
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)  # (past the limit: ignored)
    assert load_sampling_defaults(str(nested)) == {}
