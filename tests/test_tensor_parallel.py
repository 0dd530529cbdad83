"""Tensor parallelism on CPU (gloo, 2 ranks): the shard layout, sharded loading, and greedy
parity of ``tensor_parallel_size=2`` with one rank and with transformers."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from common import SamplingParams
from common.structured_outputs import StructuredOutputsParams
from executor.loader import load_weights
from executor.model_config import load_config
from executor.parallel import CMD_PING, ShardLayout, TensorParallel
from executor.shard_loader import load_shard
from gateway.llm import LLM
from tests.test_engine import hf_greedy, random_prompts

pytestmark = pytest.mark.model

MAX_TOKENS = 8
# One thread per rank: two ranks share this machine's two cores.
OPTIONS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=8, num_threads=1
)


def _cfg(heads: int, kv_heads: int, inter: int = 128, vocab: int = 1001) -> Any:
    from executor.model_config import HFModelConfig

    return HFModelConfig("LlamaForCausalLM", vocab, 64, inter, 2, heads, kv_heads, 16, 1e-5, 1e4, None, 2048, False, False, False)


@pytest.mark.parametrize("heads, kv_heads, world", [(4, 2, 2), (4, 1, 2), (4, 2, 4), (8, 8, 4), (8, 2, 8)])
def test_layout_gives_each_query_head_its_kv_head(heads: int, kv_heads: int, world: int) -> None:
    cfg = _cfg(heads, kv_heads)
    group = heads // kv_heads
    seen_q: list[int] = []
    for rank in range(world):
        lay = ShardLayout.build(cfg, rank, world)
        local_group = lay.num_heads // lay.num_kv_heads
        assert lay.num_heads * lay.num_kv_heads and lay.num_heads % lay.num_kv_heads == 0
        for j in range(lay.num_heads):  # the local GQA mapping is the global one
            q = lay.q_heads[0] + j
            assert lay.kv_heads[0] + j // local_group == q // group
            seen_q.append(q)
        replicated = world > kv_heads
        assert lay.num_kv_heads == (1 if replicated else kv_heads // world)
        assert lay.inter == (rank * 128 // world, (rank + 1) * 128 // world)
    assert seen_q == list(range(heads))
    vocab = [ShardLayout.build(cfg, r, world).vocab for r in range(world)]
    assert vocab[0][0] == 0 and vocab[-1][1] == 1001 and all(a[1] == b[0] for a, b in zip(vocab, vocab[1:]))


@pytest.mark.parametrize("heads, kv_heads, world, match", [(4, 2, 3, "attention heads"), (6, 3, 2, "KV heads"), (4, 4, 4, "")])
def test_layout_refuses_uneven_splits(heads: int, kv_heads: int, world: int, match: str) -> None:
    if not match:  # control: splits, with a 128-column MLP over 4
        ShardLayout.build(_cfg(heads, kv_heads), 0, world)
        with pytest.raises(ValueError, match="intermediate_size"):
            ShardLayout.build(_cfg(heads, kv_heads, inter=130), 0, world)
        return
    with pytest.raises(ValueError, match=match):
        ShardLayout.build(_cfg(heads, kv_heads), 0, world)


@pytest.mark.parametrize("arch, size", [("qwen2", "tiny-mqa"), ("llama", "tiny")])
def test_shards_put_together_are_the_weights(tiny_model, arch: str, size: str) -> None:
    model_dir = tiny_model(arch, size)
    cfg = load_config(model_dir)
    full = load_weights(model_dir, cfg, torch.float32, torch.device("cpu"))
    shards = [load_shard(model_dir, cfg, ShardLayout.build(cfg, r, 2), torch.float32, torch.device("cpu")) for r in range(2)]
    q, kv = cfg.q_size, cfg.kv_size
    local_q = q // 2
    for name in ("layers.0.o", "layers.1.down"):  # row-parallel: columns
        assert torch.equal(torch.cat([s[name] for s in shards], 1), full[name])
    assert torch.equal(torch.cat([s["layers.1.qkv"][:local_q] for s in shards]), full["layers.1.qkv"][:q])
    if cfg.num_kv_heads == 1:  # replicated: every rank holds the one K/V head
        for s in shards:
            assert torch.equal(s["layers.0.qkv"][local_q:], full["layers.0.qkv"][q:])
    else:
        k_parts = [s["layers.0.qkv"][local_q : local_q + kv // 2] for s in shards]
        assert torch.equal(torch.cat(k_parts), full["layers.0.qkv"][q : q + kv])
    inter = cfg.intermediate_size
    gate = torch.cat([s["layers.0.gate_up"][: inter // 2] for s in shards])
    assert torch.equal(gate, full["layers.0.gate_up"][:inter])
    assert torch.equal(torch.cat([s["embed"] for s in shards])[: cfg.vocab_size], full["embed"])
    assert shards[0]["lm_head"].shape[0] == shards[1]["lm_head"].shape[0] == -(-cfg.vocab_size // 2)
    if cfg.attention_bias:  # column-parallel biases are sliced with their rows
        assert torch.equal(torch.cat([s["layers.0.qkv_bias"][:local_q] for s in shards]), full["layers.0.qkv_bias"][:q])


def _parity(model_dir: Any, tp_llm: LLM) -> LLM:
    """Greedy tokens and logprobs of ``tp_llm`` against one rank and transformers; returns the one-rank LLM."""
    vocab = tp_llm.executor.info.vocab_size
    prompts = random_prompts(vocab)[:7]  # 1-64 tokens: chunked prefills share steps with decodes
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    got = tp_llm.generate(prompts, params)
    single = LLM(model_dir, **OPTIONS)
    one = single.generate(prompts, params)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, a, b in zip(prompts, got, one):
        want, _ = hf_greedy(hf, prompt, MAX_TOKENS)
        assert a.token_ids == b.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert a.logprobs is not None and b.logprobs is not None
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    tp_llm.cache_manager.check_invariants()
    return single


@pytest.mark.parametrize("arch, size", [("llama", "tiny"), ("qwen2", "tiny-mqa"), ("qwen3", "tiny")])
def test_tp2_parity(tiny_model, arch: str, size: str) -> None:
    """llama (2 KV heads: one per rank); qwen2 with one KV head (replicated on both ranks; tied
    embeddings, q/k/v biases); qwen3 (q/k norms, head_dim != hidden/heads)."""
    model_dir = tiny_model(arch, size)
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        one = _parity(model_dir, llm)
        # The KV budget is per rank, and a rank holds 1/2 of the KV heads (or the one head).
        share = 1 if size == "tiny-mqa" else 2
        assert llm.executor.info.num_blocks == share * one.executor.info.num_blocks
        if arch == "llama":  # a grammar, whose masks only rank 0 computes (the rank that samples)
            regex = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[a-e]{2,9}x"))
            got, want = llm.generate([[5, 6, 7], [9] * 20], regex), one.generate([[5, 6, 7], [9] * 20], regex)
            assert [o.token_ids for o in got] == [o.token_ids for o in want] and {o.finish_reason for o in got} == {"stop"}
    finally:
        llm.shutdown()


def test_tp_size_must_split_the_heads(tiny_model) -> None:
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(tiny_model("llama"), tensor_parallel_size=3, **OPTIONS)


def test_dead_rank_stops_the_offline_engine(tiny_model) -> None:
    """A rank killed: the executor refuses further steps (rank 0 in the user's process does not exit)."""
    tp_llama = LLM(tiny_model("llama"), tensor_parallel_size=2, **OPTIONS)
    assert len(tp_llama.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2
    with pytest.raises(ValueError, match="one tensor-parallel executor per process"):
        LLM(tiny_model("llama"), tensor_parallel_size=2, **OPTIONS)
    pids = tp_llama.executor.pids  # type: ignore[union-attr]
    assert pids[0] == os.getpid() and len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while tp_llama.executor.dead is None and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {pids[1]}\\) exited"):
        tp_llama.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    tp_llama.shutdown()


def test_step_failing_on_rank0_after_the_forward_is_recovered_everywhere(tiny_model, monkeypatch) -> None:
    """Rank 0's sampling fails once (after every rank ran the forward pass): the other rank is
    told (`PeerStepFailed`) and every rank drops its state. The offline engine raises the error
    (as with one rank); the next requests run on both ranks with the tokens of one rank."""
    model_dir = tiny_model("llama")
    prompts = random_prompts(1000, seed=5)[:4]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in LLM(model_dir, **OPTIONS).generate(prompts, params)]
    import executor.tp_executor as tp_executor

    monkeypatch.setattr(tp_executor, "PING_INTERVAL_S", 0.15)  # idle pings interleave with the steps
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        ex: Any = llm.executor
        sent: list[int] = []
        command = ex._command
        ex._command = lambda cmd, payload=b"": (sent.append(cmd), command(cmd, payload))[1]
        time.sleep(0.6)
        assert CMD_PING in sent
        inner = ex.inner
        sample, calls = inner._sample, []

        def flaky(*args: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected sampling failure on rank 0")
            return sample(*args)

        inner._sample = flaky
        with pytest.raises(RuntimeError, match="injected sampling failure"):
            llm.generate(prompts, params)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert len(calls) > 3
        assert llm.executor.dead is None  # type: ignore[union-attr]
    finally:
        llm.shutdown()


def test_step_failing_on_rank0_inside_the_forward_stops_the_unit(tiny_model, monkeypatch) -> None:
    """Rank 0 fails between two all-reduces: rank 1 is left inside a collective that rank 0 will
    never join, so no later command can reach it. The executor stops as one unit, at once (rank 1
    killed), and refuses later steps with the reason, instead of hanging or mixing commands with
    the collective rank 1 waits in."""
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, **OPTIONS)
    try:
        ex: Any = llm.executor
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
        all_reduce, calls = TensorParallel.all_reduce, []

        def flaky(self: TensorParallel, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 3:  # the embedding's and layer 0's attention are done
                raise RuntimeError("injected failure inside the forward on rank 0")
            return all_reduce(self, x)

        monkeypatch.setattr(TensorParallel, "all_reduce", flaky)  # in this process: rank 0 only
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="injected failure inside the forward"):
            llm.generate([[5, 6, 7]], params)
        assert ex.dead is not None and "out of step" in ex.dead
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate([[8, 9]], params)
        assert time.monotonic() - t0 < 10
        ex.procs[0].join(5)
        assert ex.procs[0].exitcode is not None  # not left waiting in the collective
        with pytest.raises(RuntimeError, match="out of step"):
            ex.check_device()  # the service then exits, and its requests are recovered elsewhere
    finally:
        llm.shutdown()


def test_interrupt_on_rank0_before_the_forward_stops_the_unit(tiny_model, monkeypatch) -> None:
    """An interrupt (Ctrl-C in a notebook) that reaches rank 0 after the step was sent, before the
    forward pass: rank 1 goes on into the forward's collectives alone. Before, the reset that
    followed waited for rank 1 until the collectives' timeout (10 minutes); now the unit stops."""
    from executor.model_executor import ModelExecutor

    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, **OPTIONS)
    try:
        ex: Any = llm.executor
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        run = ModelExecutor._run

        def interrupted(self: ModelExecutor, *args: Any, **kwargs: Any) -> Any:
            raise KeyboardInterrupt

        monkeypatch.setattr(ModelExecutor, "_run", interrupted)  # in this process: rank 0 only
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], params)
        monkeypatch.setattr(ModelExecutor, "_run", run)
        assert ex.dead is not None and "KeyboardInterrupt" in ex.dead and "out of step" in ex.dead
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate([[8, 9]], params)
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()


def test_prompt_logprobs_failing_on_rank0_is_a_step_error(tiny_model, monkeypatch) -> None:
    """Prompt logprobs are rank 0's alone, after the last collective: their failure (a large
    prompt's out-of-memory, say) fails the step as on one rank, in a prefill chunk that samples
    nothing and in one that samples, and the unit goes on."""
    import executor.model_executor as model_executor

    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, **OPTIONS)
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
        long_prompt, short_prompt = list(range(3, 103)), [5, 6, 7]  # 100 tokens: chunks of 48
        want = [o.token_ids for o in llm.generate([long_prompt, short_prompt], params)]
        real = model_executor.prompt_logprobs_of
        for prompt in (long_prompt, short_prompt):
            calls: list[int] = []

            def failing(*args: Any, calls: list[int] = calls) -> Any:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("injected prompt-logprobs failure on rank 0")
                return real(*args)

            monkeypatch.setattr(model_executor, "prompt_logprobs_of", failing)
            with pytest.raises(RuntimeError, match="injected prompt-logprobs failure"):
                llm.generate([prompt], params)
            assert llm.executor.dead is None  # type: ignore[union-attr]
            monkeypatch.setattr(model_executor, "prompt_logprobs_of", real)
        got = llm.generate([long_prompt, short_prompt], params)
        assert [o.token_ids for o in got] == want and all(o.prompt_logprobs for o in got)
    finally:
        llm.shutdown()


def test_a_rank_leaves_only_on_errors_that_break_the_lockstep(tiny_model) -> None:
    """`serve_rank` (a rank > 0): a bad step's `ValueError` before the collectives, and rank 0's
    failed sampling, leave the ranks in step (the rank goes on); the same `ValueError` amid the
    collectives or after the last one (rank 0 succeeded: the states now differ), or a step it
    cannot decode, end the rank."""
    from common.protocol import SchedulerOutput, encode
    from executor.parallel import CMD_STEP, CMD_STOP, PeerStepFailed, StepPhase
    from executor.tp_executor import serve_rank

    layout = ShardLayout.build(load_config(tiny_model("llama")), 1, 2)
    step = encode(SchedulerOutput(step=1, epoch=1))

    class Channel(TensorParallel):
        def __init__(self, commands: list[tuple[int, bytes]]) -> None:
            super().__init__(1, 2, layout, torch.device("cpu"))
            self.commands = commands

        def recv_command(self) -> tuple[int, bytes]:
            return self.commands.pop(0)

    def run(fail: Any, commands: list[tuple[int, bytes]]) -> Channel:
        channel = Channel(commands)

        class Executor:
            def execute_model(self, output: Any) -> None:
                fail(channel)

        serve_rank(channel, Executor())
        return channel

    def bad_step(channel: Channel) -> None:
        raise ValueError("bad step")

    def amid(channel: Channel) -> None:
        channel.enter_collectives()
        raise ValueError("raised on this rank alone, amid the forward")

    def after_the_step(channel: Channel) -> None:  # rank 0 succeeded: this rank's state now differs
        channel.enter_collectives()
        channel.end_step()
        raise ValueError("failed on this rank alone after the last collective")

    def rank0_failed(channel: Channel) -> None:
        channel.enter_collectives()
        channel.end_step()  # (what share_tokens does once rank 0's failure is broadcast)
        raise PeerStepFailed("rank 0 failed to sample this step")

    for fail in (bad_step, rank0_failed):
        assert run(fail, [(CMD_STEP, step), (CMD_STEP, step), (CMD_STOP, b"")]).phase == StepPhase.AGREED
    with pytest.raises(ValueError, match="amid the forward"):
        run(amid, [(CMD_STEP, step), (CMD_STOP, b"")])
    with pytest.raises(ValueError, match="after the last collective"):
        run(after_the_step, [(CMD_STEP, step), (CMD_STOP, b"")])
    with pytest.raises(ValueError):
        run(bad_step, [(CMD_STEP, b"\xc1 not msgpack"), (CMD_STOP, b"")])
