"""The ops keep no module-level state: each executor has its own memos and buffers.

Two engines in one process, run at the same time on two threads, give exactly the outputs each
gives alone (shared gather buffers or memos would mix one engine's K/V or plan into the other's).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import random
import threading
import types

import pytest
import torch

from common import SamplingParams
from executor import ops_torch
from executor.attention_metadata import AttentionMetadata
from executor.backends import get_ops

pytestmark = pytest.mark.model


def _mutable_globals(module: types.ModuleType) -> list[str]:
    """Module attributes holding mutable data (containers, tensors, instances with state)."""
    bad = []
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, (types.ModuleType, type, types.FunctionType)):
            continue
        if name == "annotations" and type(value).__name__ == "_Feature":  # from __future__ import annotations
            continue
        if isinstance(value, (int, float, str, bytes, bool, tuple, frozenset, type(None))):
            continue
        if callable(value):  # jitted kernels, lru_cache-wrapped pure functions, typing helpers
            continue
        if type(value).__name__ == "Ops":  # the frozen, stateless Triton op table
            continue
        bad.append(f"{module.__name__}.{name}: {type(value).__name__}")
    return bad


def test_no_module_level_mutable_state(monkeypatch) -> None:
    modules = [ops_torch, importlib.import_module("executor.ops")]
    if importlib.util.find_spec("triton") is not None:
        if not torch.cuda.is_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # what executor.kernels would set; restored after
        kernels = importlib.import_module("executor.kernels")
        modules.append(kernels)
        modules += [importlib.import_module(f"executor.kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    found = [b for m in modules for b in _mutable_globals(m)]
    assert not found, found
    assert not hasattr(ops_torch, "OPS")  # a shared torch op table would share its state


def test_each_executor_gets_its_own_torch_ops() -> None:
    a, b = get_ops("torch"), get_ops("torch")
    assert a.paged_attention.__self__ is not b.paged_attention.__self__
    assert a.write_kv.__self__ is a.paged_attention.__self__ is a.rotary.__self__


def _meta(q_lens: list[int], s_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
        query_lens_list=q_lens,
        seq_lens_list=s_lens,
    )


def test_memoised_ops_equal_stateless_ones_step_after_step() -> None:
    """The per-executor memos refresh on each step's new metadata/positions (no stale reuse)."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(40, 4, 2, 8, generator=g), torch.randn(40, 4, 2, 8, generator=g)
    table = torch.randn(64, 16, generator=g)
    ops = get_ops("torch")
    steps = [([1, 1, 1], [9, 5, 13]), ([6, 1], [6, 11]), ([3], [7]), ([1, 1, 1], [10, 6, 14])]
    for q_lens, s_lens in steps:
        tables = [list(range(i * 4, i * 4 + -(-s // 4))) for i, s in enumerate(s_lens)]
        meta = _meta(q_lens, s_lens, tables)
        q = torch.randn(sum(q_lens), 4, 8, generator=g)
        for _ in range(2):  # two "layers" of one step share the memo
            got = ops.paged_attention(q, k_cache, v_cache, meta, 0.3)
            torch.testing.assert_close(got, ops_torch.paged_attention(q, k_cache, v_cache, meta, 0.3), rtol=0, atol=0)
        positions = torch.randint(0, 64, (sum(q_lens),), generator=g)
        qa, ka = torch.randn(len(positions), 4, 16, generator=g), torch.randn(len(positions), 2, 16, generator=g)
        qb, kb = qa.clone(), ka.clone()
        ops.rotary(qa, ka, positions, table)
        ops_torch.rotary(qb, kb, positions, table)
        assert torch.equal(qa, qb) and torch.equal(ka, kb)
        slots = torch.tensor([3, -1, 7, 12, -1, 0][: len(positions)] + [20] * max(0, len(positions) - 6))
        kc1, vc1, kc2, vc2 = (torch.zeros(8, 4, 2, 16) for _ in range(4))
        ops.write_kv(ka, ka, kc1, vc1, slots)
        ops_torch.write_kv(ka, ka, kc2, vc2, slots)
        assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)


PROMPT_LENS = [3, 9, 17, 30, 44, 5, 61, 12]


def _requests(vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    # Greedy and seeded rows only: unseeded rows would depend on the engine generator's history.
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
        if i % 2
        else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True, logprobs=3)
        for i in range(len(prompts))
    ]
    return prompts, params


def _engine(model_dir):
    from gateway.llm import LLM

    # A small step budget: chunked prefills mixed with decodes, over a few dozen steps.
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        block_size=8,
        num_blocks=256,
        max_model_len=256,
        max_num_batched_tokens=40,
        max_num_seqs=6,
        seed=7,
    )


def _run(llm, prompts, params) -> list[tuple[list[int], list]]:
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]


def test_two_engines_on_two_threads_match_each_alone(tiny_model) -> None:
    models = [tiny_model("llama"), tiny_model("qwen2")]
    inputs = [_requests(1000, seed) for seed in (1, 2)]
    alone = []
    for model_dir, (prompts, params) in zip(models, inputs):
        llm = _engine(model_dir)
        alone.append(_run(llm, prompts, params))
        assert llm.scheduler.num_steps >= 30, llm.scheduler.num_steps

    for attempt in range(2):
        engines = [_engine(m) for m in models]
        results: list = [None, None]
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def work(i: int, barrier: threading.Barrier, engines: list, results: list, errors: list[BaseException]) -> None:
            try:
                barrier.wait()
                results[i] = _run(engines[i], *inputs[i])
            except BaseException as exc:  # surfaced below, with the thread's traceback
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i, barrier, engines, results, errors)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        for i in range(2):
            assert results[i] is not None
            for j, (got, want) in enumerate(zip(results[i], alone[i])):
                assert got[0] == want[0], f"attempt {attempt}: engine {i}, prompt {j}: tokens differ"
                assert got[1] == want[1], f"attempt {attempt}: engine {i}, prompt {j}: logprobs differ"


def test_import_order_has_no_cycle() -> None:
    """``executor.ops`` and ``executor.kernels`` import cleanly first, in either order."""
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    for first, second in [
        ("executor.ops", "executor.kernels"),
        ("executor.kernels", "executor.ops"),
        ("executor.kernels.decode_split", "executor.ops_torch"),
    ]:
        code = f"import {first}, {second}; from executor.backends import get_ops; get_ops('torch')"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
