"""Routing by cached prefix against first-block affinity and least-loaded, on a multi-turn chat workload.

    python -m bench.routing                       # 32 conversations x 6 turns, 4 engines of 256 blocks
    python -m bench.routing --weights 1,2,4,8     # cache_aware at several overlap weights

Simulated in-process, in virtual time (a real 4-engine stack does not fit 2 CPU cores): each engine
is the real `Scheduler` and `CacheManager` (prefix caching on) over an executor that returns a
token at once, and every request is routed by the real gateway code (`EngineClient.pick_engine`
and `count_routed`, over the engines' `EngineStatus` as their heartbeats would publish them, read
every `ServiceDefaults.liveness_check_s`). A step takes ``--step-ms`` plus ``--token-us`` per token
it computes, so a prefix-cache hit shortens the prefill it saves. Each conversation sends its
turns one after another (a think time after each answer), every turn resending the whole
history: a system prompt all conversations share, then each user message and answer so far.

Reports per policy the prefix-cache hit rate (hit tokens / prompt tokens looked up, the
schedulers' own counters) and the TTFT (arrival to first token, virtual seconds), and the same
workload on one engine with all the blocks (``--engines`` x ``--num-blocks``) for reference: the
hit rate routing could reach if every engine saw every prefix.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field

from bench.prefix_overhead import NullExecutor
from common.config import SchedulerConfig, ServiceDefaults
from common.protocol import EngineStatus, Names, SchedulerOutput
from common.sampling_params import SamplingParams
from gateway.engine.client import EngineClient
from gateway.engine.routing import DEFAULT_OVERLAP_WEIGHT, ROUTING_POLICIES
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.request import Request
from scheduler.scheduler import Scheduler


class TimedExecutor(NullExecutor):
    """`NullExecutor` that counts the tokens of the step it ran (the step's simulated length)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, max_model_len)
        self.last_tokens = 0

    def execute_model(self, output: SchedulerOutput):  # type: ignore[no-untyped-def]
        """The step's result at once, its token count kept for the clock."""
        self.last_tokens = sum(output.num_scheduled_tokens)
        return super().execute_model(output)


@dataclass(slots=True)
class Engine:
    """One simulated engine: its core, its executor and its clock (virtual seconds)."""

    sid: str
    core: EngineCore
    executor: TimedExecutor
    clock: float = 0.0

    def status(self) -> EngineStatus:
        """The status this engine would publish now (its load and cached prefixes)."""
        s, cache = self.core.scheduler, self.core.scheduler.cache
        assert isinstance(cache, CacheManager)
        return EngineStatus(
            self.sid, "inc", "sim", "/sim", 1 << 20, 1 << 16, cache.block_size, cache.total_blocks, "x", 1,
            cache.get_num_free_blocks(), len(s.running), len(s.waiting), s.num_steps, s.num_preemptions, 0, self.clock,
            cached_prefixes=cache.summary.encode(),
        )  # fmt: skip


@dataclass(slots=True)
class Conversation:
    """A chat: its history so far and its turns still to send (user messages, answer lengths)."""

    history: list[int]
    turns: list[tuple[list[int], int]]
    arrivals: list[float] = field(default_factory=list)


def make_conversations(args: argparse.Namespace, rng: random.Random) -> list[Conversation]:
    """``--conversations`` conversations sharing a system prompt, each with its own turns."""
    system = [rng.randrange(3, 30000) for _ in range(args.system_tokens)]
    out = []
    for _ in range(args.conversations):
        turns = [
            ([rng.randrange(3, 30000) for _ in range(rng.randint(*args.user_tokens))], rng.randint(*args.answer_tokens))
            for _ in range(args.turns)
        ]
        out.append(Conversation(list(system), turns))
    return out


def run(policy: str, weight: float, engines_n: int, num_blocks: int, args: argparse.Namespace) -> dict[str, float]:
    """Serve the workload over ``engines_n`` engines of ``num_blocks`` blocks each, routed by ``policy``."""
    rng = random.Random(args.seed)
    random.seed(args.seed)  # the router breaks ties at random: the same run, the same choices
    convs = make_conversations(args, rng)
    client = EngineClient("redis://unused", Names("bench-routing"), "g", routing=policy, routing_overlap_weight=weight)
    config = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, enable_prefix_caching=True)
    engines: dict[str, Engine] = {}
    for i in range(engines_n):
        ex = TimedExecutor(num_blocks, args.block_size, 1 << 20)
        sched = Scheduler(config, CacheManager(num_blocks, args.block_size), ex.info)
        engines[str(i)] = Engine(str(i), EngineCore(sched, InlineExecutor(ex)), ex)
    # Arrivals: (time, conversation index); a conversation's next turn is queued when its answer ends.
    arrivals = [(rng.uniform(0, args.start_spread_s), c) for c in range(len(convs))]
    heapq.heapify(arrivals)
    requests: dict[str, tuple[int, float, Request]] = {}  # request id -> (conversation, arrival, request)
    ttfts: list[float] = []
    next_refresh, n = 0.0, 0
    while arrivals or any(e.core.has_work() for e in engines.values()):
        busy = [e for e in engines.values() if e.core.has_work()]
        first = min(busy, key=lambda e: e.clock) if busy else None
        if arrivals and (first is None or arrivals[0][0] <= first.clock):
            now, c = heapq.heappop(arrivals)
            while next_refresh <= now:  # the gateway's watch reads the statuses as of then
                client.set_engines({e.sid: e.status() for e in engines.values()})
                next_refresh += ServiceDefaults.liveness_check_s
            conv = convs[c]
            user, answer = conv.turns.pop(0)
            prompt = conv.history + user
            hashes = client.prompt_hashes(prompt)
            status = client.pick_engine(prompt, hashes=hashes)
            assert status is not None
            client.count_routed(status, prompt, hashes)
            target = engines[status.scheduler_id]
            if not target.core.has_work():
                target.clock = max(target.clock, now)
            rid = f"r{n}"
            n += 1
            req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True))
            requests[rid] = (c, now, req)
            target.core.scheduler.add_request(req)
            conv.history = prompt
            continue
        assert first is not None
        outputs = first.core.step()
        first.clock += args.step_ms / 1e3 + first.executor.last_tokens * args.token_us / 1e6
        for out in outputs:
            c, arrived, req = requests[out.request_id]
            if out.num_output_tokens == len(out.new_token_ids) and out.new_token_ids:
                ttfts.append(first.clock - arrived)
            if out.finished:
                del requests[out.request_id]
                convs[c].history = convs[c].history + list(req.output_token_ids)
                if convs[c].turns:
                    heapq.heappush(arrivals, (first.clock + rng.uniform(*args.think_s), c))
    queries = sum(e.core.scheduler.prefix_cache_queries for e in engines.values())
    hits = sum(e.core.scheduler.prefix_cache_hits for e in engines.values())
    ttfts.sort()
    return {
        "hit_rate": hits / max(1, queries),
        "ttft_mean": statistics.fmean(ttfts),
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p90": ttfts[int(len(ttfts) * 0.9)],
        "requests": len(ttfts),
        "makespan": max(e.clock for e in engines.values()),
    }


def span(text: str) -> tuple[int, int]:
    """``"a-b"`` (or ``"a"``) as ``(a, b)`` integers."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def fspan(text: str) -> tuple[float, float]:
    """``"a-b"`` (or ``"a"``) as ``(a, b)`` floats."""
    lo, _, hi = text.partition("-")
    return float(lo), float(hi or lo)


def main(argv: list[str] | None = None) -> int:
    """Simulate every routing policy asked for and print their hit rates and TTFTs."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.routing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks per engine")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=40, help="the system prompt every conversation starts with")
    ap.add_argument("--user-tokens", type=span, default=(20, 80), help="a user message's length, lo-hi")
    ap.add_argument("--answer-tokens", type=span, default=(20, 80), help="an answer's length, lo-hi")
    ap.add_argument("--think-s", type=fspan, default=(0.5, 3.0), help="the pause before a conversation's next turn, lo-hi")
    ap.add_argument("--start-spread-s", type=float, default=4.0, help="conversations start within this many seconds")
    ap.add_argument("--step-ms", type=float, default=8.0, help="a step's fixed time")
    ap.add_argument("--token-us", type=float, default=60.0, help="a step's time per token it computes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--weights", default=str(DEFAULT_OVERLAP_WEIGHT), help="cache_aware overlap weights to run, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows: list[tuple[str, dict[str, float]]] = []
    for policy in ROUTING_POLICIES:
        for w in [float(x) for x in args.weights.split(",")] if policy == "cache_aware" else [1.0]:
            label = f"{policy} (weight {w:g})" if policy == "cache_aware" else policy
            rows.append((label, run(policy, w, args.engines, args.num_blocks, args)))
    ref = run("least_loaded", 1.0, 1, args.engines * args.num_blocks, args)
    rows.append((f"reference: 1 engine x {args.engines * args.num_blocks} blocks", ref))
    print(
        f"{args.conversations} conversations x {args.turns} turns, {args.engines} engines x {args.num_blocks} blocks "
        f"of {args.block_size}, seed {args.seed}"
    )
    print(f"{'routing':<40} {'hit rate':>8} {'vs ref':>7} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'makespan':>9}")
    for label, r in rows:
        print(
            f"{label:<40} {r['hit_rate']:8.3f} {r['hit_rate'] / max(ref['hit_rate'], 1e-9):7.2f} {r['ttft_mean']:10.3f} "
            f"{r['ttft_p50']:8.3f} {r['ttft_p90']:8.3f} {r['makespan']:9.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
