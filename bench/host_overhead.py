"""The executor's host work per decode step, with the forward pass replaced by a stub.

    python -m bench.host_overhead                 # decodes at 16, 64 and 256 running requests
    python -m bench.host_overhead --steps 400 --context 2048

A real `ModelExecutor` (the cached tiny checkpoint) runs decode-only steps of ``N`` requests at
``--context`` tokens each; its model is swapped for a stub that returns hidden states of the real
shape and logits over a small vocabulary (`STUB_VOCAB` columns, zeros) at once, so what is timed is
the host's share of a step: decoding the step message, applying it to the persistent batch and
building the step's inputs, sampling's bookkeeping, and packing and encoding the result
(`ExecutorService._step`). The greedy argmax over ``N x vocabulary`` logits is the device's work
on a GPU, not host bookkeeping; over the real vocabulary it would be one CPU thread's compute that
grows with the batch, so the stub's vocabulary is kept small (the sampled ids stay valid tokens). Every step crosses
into a new block for a sixteenth of the requests, as real decodes do. Prints one line per batch
size, then the ratio of the largest batch's cost to the smallest's: the host cost per step should
grow far slower than the batch (a per-block or per-token Python loop makes it grow with
batch x context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common.config import CacheConfig, ModelConfig, ParallelConfig
from common.protocol import SchedulerOutput, decode, encode
from common.sampling_params import SamplingParams
from executor.make_model import cached_model
from executor.model_executor import ModelExecutor
from executor.service import ExecutorService

BATCHES = (16, 64, 256)
STUB_VOCAB = 16  # the stub's logits' columns: the argmax, device work on a GPU, stays out of the timing


class StubModel:
    """Stands in for the model: hidden states of the right shape and logits over ``vocab_size``
    columns (views of buffers made once), no computation."""

    def __init__(self, hidden_size: int, vocab_size: int, max_rows: int) -> None:
        self.hidden = torch.zeros(max_rows, hidden_size)
        self.logits = torch.zeros(max_rows, vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: Any) -> torch.Tensor:
        """Hidden states of the step's shape, at once."""
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Zero logits over the stub's vocabulary, at once."""
        return self.logits[: hidden.shape[0]]


def long_tiny_model(max_len: int, out: Path) -> Path:
    """The cached tiny checkpoint with room for ``max_len`` positions (its weights linked, not copied)."""
    src = cached_model("llama", "tiny")
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = max(max_len, config["max_position_embeddings"])
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


def make_executor(max_seqs: int, context: int, steps: int, block_size: int, model_dir: Path) -> ModelExecutor:
    """A tiny-model executor with room for ``max_seqs`` requests of ``context + steps`` tokens."""
    max_len = context + steps + block_size
    num_blocks = max_seqs * (-(-max_len // block_size)) + 1
    ex = ModelExecutor(
        ModelConfig(
            str(long_tiny_model(max_len, model_dir)),
            dtype="float32",
            device="cpu",
            max_model_len=max_len,
            num_threads=1,
            cpu_decode_kernel="off",  # it would run the real model past the stub
        ),
        ParallelConfig(),
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
    )
    ex.model = StubModel(ex.hf_config.hidden_size, STUB_VOCAB, max_seqs)  # type: ignore[assignment]
    return ex


def scheduled(out: SchedulerOutput, request_id: str, start: int) -> None:
    """One decode row: one token at ``start``, sampled (the last known token)."""
    out.add_scheduled(request_id, 1, start, True)


def run(ex: ModelExecutor, n: int, context: int, steps: int) -> float:
    """Median host microseconds per decode step of ``n`` requests at ``context`` tokens."""
    bs = ex.block_size
    blocks_per_seq = -(-(context + steps + 1) // bs)
    ex.reset()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(n)]
    prompt = [(7 * j) % ex.info.vocab_size for j in range(context)]
    # The requests arrive with their context already computed (a prefix hit), decoding from there.
    first = SchedulerOutput(step=1, epoch=1)
    for i in range(n):
        first.add_new(f"r{i}", params, context, prompt, tables[i][: -(-context // bs)])
        scheduled(first, f"r{i}", context - 1)
    ex.execute_model(decode(encode(first)))
    messages: list[bytes] = []
    known = [-(-context // bs)] * n
    for k in range(steps):
        out = SchedulerOutput(step=2 + k, epoch=1)
        pos = context + k
        for i in range(n):
            need = pos // bs + 1
            if need > known[i]:
                out.add_cached(f"r{i}", False, tables[i][known[i] : need])
                known[i] = need
            scheduled(out, f"r{i}", pos)
        messages.append(encode(out))
    service = ExecutorService.__new__(ExecutorService)
    service.model = ex
    times = []
    for data in messages:
        t0 = time.perf_counter()
        result = service._step(decode(data))
        encode(result)
        times.append(time.perf_counter() - t0)
        assert result.error is None, result.error
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    """Time the host's work per step at each batch size and print the lines the module names."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=2048, help="tokens of context per request")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    cost: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ex = make_executor(max(BATCHES), args.context, args.steps, args.block_size, Path(tmp))
        for n in BATCHES:
            cost[n] = run(ex, n, args.context, args.steps)
            print(f"decodes {n}: host {cost[n]:.0f} us per step", flush=True)
    print(f"host cost at {BATCHES[-1]} / at {BATCHES[0]}: {cost[BATCHES[-1]] / cost[BATCHES[0]]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
