"""The engine over Redis, without HTTP: scheduler + executor processes against in-process `LLM`.

    python -m bench.engine_redis --model DIR [--scheduler-arg=--no-async-scheduling] [--repeat 3]

Starts one engine (executor and scheduler processes, no gateway) and plays a gateway itself:
bench.offline's workload goes straight into the scheduler's requests stream as `GenerateRequest`s
and the outputs are read back from this process's outputs stream. The same requests then run
in-process through `LLM.generate`; runs alternate, and the best of each is reported, so the ratio
isolates what the split into services costs the engine (streams, msgpack, the round trips),
apart from the gateway's HTTP, tokenization and SSE work.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench.offline import WORKLOADS, make_workload, prompt_ids
from common.protocol import GenerateRequest, StepOutputs, decode, encode
from infra.stack import Stack

GATEWAY_ID = "bench"


class DirectClient:
    """Sends requests to engine 0 and collects their outputs, as a gateway would."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.redis = redis.Redis.from_url(stack.redis_url)
        self.names = stack.names
        self.cursor: bytes | str = "0-0"
        # The scheduler aborts the requests of gateways without a heartbeat.
        self.redis.set(self.names.heartbeat("gateway", GATEWAY_ID), "1", px=3_600_000)

    def run(self, prompts: list[list[int]], outs: list[int]) -> float:
        """Output tokens per second for the whole workload, sent at once."""
        incarnation = self.stack.stats().incarnation
        tag = uuid.uuid4().hex[:6]
        pipe = self.redis.pipeline(transaction=False)
        t = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, outs)):
            sampling = {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}
            msg = GenerateRequest(f"{tag}-{i}", GATEWAY_ID, "0", incarnation, prompt, [], sampling, 0.0)
            pipe.xadd(self.names.requests("0"), {b"m": encode(msg)})
        pipe.execute()
        finished = tokens = 0
        while finished < len(prompts):
            reply: Any = self.redis.xread({self.names.outputs(GATEWAY_ID): self.cursor}, block=5000)
            for _, entries in reply or []:
                for entry_id, entry in entries:
                    self.cursor = entry_id
                    out = decode(entry[b"m"], (StepOutputs,))
                    tokens += len(out.token_ids)
                    finished += sum(out.finished)
        elapsed = time.perf_counter() - t
        assert tokens == sum(outs), (tokens, sum(outs))
        return tokens / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_redis", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload", default="uniform", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra scheduler flag (repeatable)")
    args = p.parse_args(argv)

    from common.sampling_params import SamplingParams
    from gateway.llm import LLM

    work = make_workload(args.workload, args.num_requests)
    outs = list(work.output_lens)
    stack = Stack(
        args.model,
        Path(tempfile.mkdtemp(prefix="bench-engine-")),
        gateways=0,
        executor_args=("--num-blocks", str(args.num_blocks)),
        scheduler_args=tuple(args.scheduler_arg),
    ).start()
    llm = LLM(args.model, num_blocks=args.num_blocks)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]

    def offline(prompts: list[list[int]]) -> float:
        t = time.perf_counter()
        llm.generate(prompts, params)
        return sum(outs) / (time.perf_counter() - t)

    try:
        client = DirectClient(stack)
        warm = prompt_ids(work, args.vocab, 8, seed=100)
        client.run(warm[:4], [4] * 4)  # warm-up both
        offline(warm)
        report: dict[str, Any] = {
            "workload": work.name,
            "requests": len(outs),
            "scheduler_args": args.scheduler_arg,
            "services_tok_s": [],
            "offline_tok_s": [],
        }
        for r in range(args.repeat):
            prompts = prompt_ids(work, args.vocab, 8, seed=101 + r)  # new prompts each round: no prefix-cache hits
            report["services_tok_s"].append(round(client.run(prompts, outs), 1))
            report["offline_tok_s"].append(round(offline(prompts), 1))
        report["services_vs_offline"] = round(max(report["services_tok_s"]) / max(report["offline_tok_s"]), 3)
    finally:
        stack.stop()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
