"""CUDA graphs for decode: the size ladder, the padding and the static buffers (on CPU), and
capture + replay against eager decoding (on CUDA only)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from common import SamplingParams
from common.config import CacheConfig, ModelConfig, ParallelConfig
from executor.cuda_graphs import MAX_CAPTURE_SIZE, CudaGraphRunner, GraphInputs, capture_sizes, padded_size
from executor.input_batch import Batch
from executor.model_executor import ModelExecutor

pytestmark = pytest.mark.model

BLOCK = 4


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(256)[-3:] == [64, 128, 256]
    assert capture_sizes(4096)[-1] == MAX_CAPTURE_SIZE
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_size() -> None:
    sizes = capture_sizes(48)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 33, 48, 49)] == [1, 2, 4, 8, 8, 16, 48, 48, None]


def _batch(lens: list[int], tables: list[list[int]], decode: bool, rng: random.Random) -> Batch:
    """Whole prompts of ``lens`` tokens (``decode``: the last token of each, the rest cached)."""
    names = "request_ids input_ids positions slot_mapping query_lens seq_lens block_tables sample output_lens sampling_params"
    b = SimpleNamespace(**{k: [] for k in names.split()})
    for i, (n, table) in enumerate(zip(lens, tables)):
        start = n - 1 if decode else 0
        b.request_ids.append(str(i))
        b.input_ids.extend(rng.randrange(3, 1000) for _ in range(start, n))
        b.positions.extend(range(start, n))
        b.slot_mapping.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, n))
        b.query_lens.append(n - start)
        b.seq_lens.append(n)
        b.block_tables.append(table)
        b.sample.append(True)
        b.output_lens.append(0)
        b.sampling_params.append(SamplingParams())
    return Batch(**vars(b))


def test_padded_decode_through_the_buffers_equals_eager(tiny_model) -> None:
    """A decode step copied into the static buffers and padded to the next size gives the eager
    step's hidden states on its rows, and the padding rows write no KV."""
    ex = ModelExecutor(
        ModelConfig(str(tiny_model()), device="cpu", dtype="float32", num_threads=1, max_model_len=256),
        ParallelConfig(),
        CacheConfig(block_size=BLOCK, num_blocks=64),
    )
    assert ex.graphs is None  # no CUDA: every step eager
    rng = random.Random(0)
    lens = [5, 9, 17]
    tables = [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10]]
    prefill = _batch(lens, tables, decode=False, rng=rng)
    with torch.inference_mode():
        ids, pos, meta, _ = ex._prepare(prefill)
        ex.model.forward(ids, pos, ex.kv_caches, meta)
        step = _batch([n + 1 for n in lens], tables, decode=True, rng=rng)
        ids, pos, meta, _ = ex._prepare(step)
        eager = ex.model.forward(ids, pos, ex.kv_caches, meta).clone()
        kv_before = [(k.clone(), v.clone()) for k, v in ex.kv_caches]
        inputs = GraphInputs(8, -(-ex.max_model_len // BLOCK), torch.device("cpu"))
        b = padded_size(3, capture_sizes(8))
        assert b == 4
        gmeta = inputs.load(ids, pos, meta, b)
        assert gmeta.num_seqs == 4 and gmeta.max_query_len == 1
        assert inputs.slot_mapping[3] == -1 and inputs.seq_lens[3] == 1 and inputs.block_tables[3, 0] == 0
        assert inputs.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
        padded = ex.model.forward(inputs.input_ids[:b], inputs.positions[:b], ex.kv_caches, gmeta)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(kv_before, ex.kv_caches):  # the same slots, the same values
        assert torch.equal(k0, k1) and torch.equal(v0, v1)

    # A smaller step after it: its rows are copied in, the rows up to its padded size reset.
    one = _batch([lens[2] + 1], [tables[2]], decode=True, rng=rng)
    ids1, pos1, meta1, _ = ex._prepare(one)
    with torch.inference_mode():  # the buffers were made in it (as a step's load runs in it)
        inputs.load(ids1, pos1, meta1, 2)
    assert inputs.input_ids[0] == ids1[0] and inputs.slot_mapping[:2].tolist() == [meta1.slot_mapping.item(), -1]
    assert inputs.seq_lens[:2].tolist() == [lens[2] + 1, 1] and inputs.block_tables[0, :5].tolist() == tables[2]


def test_load_refuses_what_a_graph_cannot_run(tiny_model) -> None:
    ex = ModelExecutor(
        ModelConfig(str(tiny_model()), device="cpu", num_threads=1, max_model_len=256),
        ParallelConfig(),
        CacheConfig(block_size=BLOCK, num_blocks=64),
    )
    ids, pos, meta, _ = ex._prepare(_batch([5, 3], [[1, 2], [3]], decode=False, rng=random.Random(0)))
    inputs = GraphInputs(4, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="only decode steps"):
        inputs.load(ids, pos, meta, 4)
    ids, pos, meta, _ = ex._prepare(_batch([5, 3, 2], [[1, 2], [3], [4]], decode=True, rng=random.Random(0)))
    with pytest.raises(ValueError, match="do not fit"):
        inputs.load(ids, pos, meta, 2)
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphRunner(lambda i, p, m: i, 8, 8, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_on_cuda(tiny_model) -> None:
    """Greedy decoding with graphs (batches of 1..8, padded) equals ``enforce_eager``."""
    from gateway.llm import LLM

    prompts = [[random.Random(i).randrange(3, 1000) for _ in range(4 + 7 * i)] for i in range(7)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        # fp32: seven rows eager and eight padded ones in a graph may take different GEMM kernels,
        # whose bf16 roundings could flip a near-tie. A KV pool of 256 blocks, not 90% of the GPU.
        llm = LLM(str(tiny_model()), device="cuda", dtype="float32", max_num_seqs=8, num_blocks=256, enforce_eager=eager)
        assert (llm.executor.graphs is None) == eager  # type: ignore[union-attr]
        if not eager:
            assert sorted(llm.executor.graphs.graphs) == [1, 2, 4, 8]  # type: ignore[union-attr]
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert outs[False] == outs[True]
