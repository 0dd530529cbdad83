"""`conveyor bench serve`: a serving benchmark against any OpenAI-compatible endpoint (ours or vLLM's).

    conveyor bench serve --base-url http://127.0.0.1:8000 --model NAME --num-prompts 200 --request-rate 8
    conveyor bench serve --start --model DIR --ignore-eos --offline   # a private stack; in-process LLM too
    conveyor bench serve --endpoint chat --dataset prompts.jsonl --result-file out.json
    python -m bench.serve ...                                         # the same command

Streams every request (``stream_options.include_usage``), sends them at once or as Poisson
arrivals (``--request-rate``) under ``--max-concurrency``, after one warm-up burst, and reports
vLLM's ``benchmark_serving`` result fields with the same definitions: TTFT, TPOT (per request,
``(e2el - ttft) / (output_tokens - 1)``, only requests of 2+ tokens), ITL (every gap between
chunks that carry output) and end-to-end latency, in mean / median / p99 ms. Token counts are the
server's ``usage``; a failed request is counted, not fatal.

Datasets: ``random`` (random prompts of ``--random-input-len`` tokens, ``--random-range-ratio``
spreads the lengths), ``shared-prefix`` (the same, after one common prefix of
``--random-prefix-len`` tokens) or a ``.jsonl`` file with one ``{"prompt": text or token ids,
"output_len": n}`` per line (``output_len`` defaults to ``--random-output-len``; lines are reused
in order when ``--num-prompts`` asks for more). Completions get token-id prompts, so no tokenizer
is needed; chat gets text (random words, or decoded random ids with ``--tokenizer``).

With the scheduler's stats key (``--redis-url``/``--namespace``; automatic with ``--start``, which
also reports every process's CPU seconds) it reports the mean engine step and the time outside the
executor; ``--offline`` runs the same requests through the in-process `LLM` for the HTTP / offline ratio.
``--repeat N`` runs N whole rounds in turn (a fresh stack each with ``--start``) and reports each
round's ratio, their median, and the best HTTP run over the best in-process one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.serve_client import ENDPOINTS, BenchError, run_event_loop, run_load
from bench.serve_data import DATASETS, BenchRequest, TokenSource, jsonl_requests, random_requests
from bench.serve_engine import cpu_seconds, offline_breakdown, read_stats, step_breakdown
from bench.serve_metrics import RequestResult, compute_metrics, format_report, output_tokens
from infra.cpu_placement import format_cpus, pinned

WARMUP_PROMPT_LEN = 8  # short random prompts of their own: nothing the timed ones could find in a prefix cache
WARMUP_OUTPUT_LEN = 2


def _names(model: str, card: dict[str, Any]) -> bool:
    # The served name, or the checkpoint as the server was given it, or the same directory spelled otherwise.
    root = card.get("root")
    if model in (card.get("id"), root):
        return True
    return bool(root) and Path(model).is_dir() and Path(str(root)).is_dir() and Path(model).resolve() == Path(str(root)).resolve()


def served_model(base_url: str, model: str | None, headers: dict[str, str]) -> tuple[str, int | None]:
    """The name to send as ``model`` and the server's ``max_model_len`` (None if it does not say),
    from ``GET /v1/models``; ``model`` may be the served name or the checkpoint path (``root``)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/v1/models", headers=headers), timeout=30) as reply:
            cards = json.loads(reply.read())["data"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        cards = []
    match = [c for c in cards if model is None or _names(model, c)]
    if not match:
        if model is None:
            raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
        return model, None
    card = match[0]
    return str(card["id"]), card.get("max_model_len")


def build_requests(args: argparse.Namespace, source: TokenSource) -> list[BenchRequest]:
    """The timed requests the arguments describe."""
    chat = args.endpoint == "chat"
    if args.dataset in DATASETS:
        prefix = args.random_prefix_len
        if prefix is None:
            prefix = 512 if args.dataset == "shared-prefix" else 0
        return random_requests(
            source,
            args.num_prompts or 64,
            args.random_input_len,
            args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=prefix,
            text=chat,
            seed=args.seed,
        )
    return jsonl_requests(Path(args.dataset), args.num_prompts, args.random_output_len, source, chat=chat)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="conveyor bench serve",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument(
        "--base-url",
        "--url",
        dest="base_url",
        default=None,
        help="server base URL without /v1 (default http://127.0.0.1:8000; --start: its own)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="served model name (default: the first of /v1/models); with --start/--offline a checkpoint dir",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (HF name or dir) for exact text prompts; optional, counts come from the server",
    )
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    p.add_argument("--dataset", default="random", help="random, shared-prefix or a .jsonl file")
    p.add_argument(
        "--num-prompts",
        "--num-requests",
        dest="num_prompts",
        type=int,
        default=None,
        help="default 64 (a .jsonl file: all its lines)",
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=128, help="also the default output_len of a .jsonl line")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument(
        "--random-prefix-len", type=int, default=None, help="shared prefix tokens (default: shared-prefix 512, random 0)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output lengths")
    p.add_argument("--result-file", type=Path, default=None, help="write the results as JSON here")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="also write per-request input_lens, output_lens, ttfts, itls, e2els, generated_texts",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for its next bytes before it counts as failed",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    g = p.add_argument_group("this engine")
    g.add_argument("--start", action="store_true", help="start a private stack of --model DIR (infra.stack.Stack)")
    g.add_argument("--redis-url", help="with --namespace: report the engine step breakdown (automatic with --start)")
    g.add_argument("--namespace")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks for --start and --offline")
    g.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        help="extra scheduler flag for --start (repeatable), e.g. --scheduler-arg=--no-async-scheduling",
    )
    g.add_argument(
        "--cpu-placement",
        choices=("auto", "off"),
        default="off",
        help="with --start, as `conveyor up --cpu-placement`: auto runs the executor on CPUs of its own and the rest of the "
        "stack (its own Redis included) and this load client on the others where the host has enough, and --offline's "
        "in-process engine on the executor's CPUs; off (default): the OS places every process",
    )
    g.add_argument("--offline", action="store_true", help="also run the same requests in-process (LLM of --model DIR)")
    g.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the whole run (a fresh stack each with --start, then --offline's in-process run), "
        "alternating, for the median and best of each side on a machine whose speed drifts",
    )
    args = p.parse_args(argv)
    if (args.start or args.offline) and not (args.model and Path(args.model).is_dir()):
        p.error("--start and --offline need --model DIR (a local checkpoint)")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if args.dataset not in DATASETS and not Path(args.dataset).is_file():
        p.error(f"--dataset: {args.dataset!r} is neither {' nor '.join(DATASETS)} nor a file")
    return args


@dataclass(slots=True)
class Round:
    """One round of the benchmark: the load's metrics and this engine's extras."""

    base_url: str
    model: str
    results: list[RequestResult]
    metrics: dict[str, Any]
    extras: dict[str, Any]


def run_round(
    args: argparse.Namespace,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    headers: dict[str, str],
    tokenizer: Any,
) -> Round:
    """The load against the server (a private stack of its own with ``--start``), then the same
    requests in-process with ``--offline``; `BenchError` if it cannot run as asked."""
    width = args.max_concurrency or len(requests)
    stack = None
    redis_url, namespace = args.redis_url, args.namespace
    base_url = (args.base_url or "http://127.0.0.1:8000").rstrip("/").removesuffix("/v1")
    if args.start:
        import tempfile

        from infra.stack import Stack

        extra = ("--num-blocks", str(args.num_blocks)) if args.num_blocks else ()
        stack = Stack(
            args.model,
            Path(tempfile.mkdtemp(prefix="bench-serve-")),
            executor_args=extra,
            scheduler_args=tuple(args.scheduler_arg),
            cpu_placement=args.cpu_placement == "auto",
        ).start()
        base_url, redis_url, namespace = stack.urls[0], stack.redis_url, stack.namespace
    extras: dict[str, Any] = {}
    try:
        model, max_model_len = served_model(base_url, args.model, headers)
        longest = max((r.prompt_len or 0) + r.output_len for r in requests)
        if max_model_len and args.dataset in DATASETS and longest > max_model_len:
            raise BenchError(
                f"requests need up to {longest} tokens, more than the server's max_model_len "
                f"({max_model_len}): lower --random-input-len/--random-output-len",
                exit_code=2,
            )
        before = read_stats(redis_url, namespace) if redis_url and namespace else None
        pids = {name: proc.pid for name, proc in stack.procs.items()} if stack is not None else {}
        if stack is not None and stack.redis_proc is not None:  # the stack's own Redis (a placed stack has one)
            pids["redis"] = stack.redis_proc.pid
        cpu0 = cpu_seconds(pids)
        # The load client stays off the executor's CPUs, as if it ran on another machine.
        with pinned(stack.placement.control if stack is not None and stack.placement is not None else None):
            results, duration = run_event_loop(
                run_load(
                    base_url,
                    args.endpoint,
                    model,
                    requests,
                    ignore_eos=args.ignore_eos,
                    request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency,
                    seed=args.seed,
                    warmup=warmup,
                    headers=headers,
                    progress=not args.disable_tqdm,
                    timeout_s=args.request_timeout,
                )
            )
        cpu1 = cpu_seconds(pids)
        # Where the machine's CPU went during the load (the warm-up burst included).
        extras["cpu_s"] = {name: round(cpu1[name] - cpu0[name], 3) for name in cpu1 if name in cpu0}
        if before is not None:
            after = read_stats(redis_url, namespace, settle_s=0.2)
            extras["service_steps"] = step_breakdown(before, after)
    finally:
        if stack is not None:
            stack.stop()
    metrics = compute_metrics(requests, results, duration, tokenizer)
    placement = stack.placement if stack is not None else None
    if placement is not None:
        extras["cpus"] = {"executor": format_cpus(placement.executors[0]), "control": format_cpus(placement.control)}
    if args.offline:
        kw = {"num_blocks": args.num_blocks} if args.num_blocks else {}
        # On the executor's CPUs, where there is a placement: the same engine on the same CPUs.
        with pinned(placement.executors[0] if placement is not None else None):
            extras["offline"] = offline_breakdown(args.model, requests, args.ignore_eos, kw, width, args.endpoint == "chat")
        extras["http_vs_offline"] = metrics["output_throughput"] / extras["offline"]["tokens_per_s"]
    return Round(base_url, model, results, metrics, extras)


def summarize(rounds: list[Round]) -> dict[str, Any]:
    """Each round's throughputs and, with in-process runs, the median of the per-round ratios and
    the ratio of the best of each side (a shared machine's interference only ever slows a run)."""
    http = [r.metrics["output_throughput"] for r in rounds]
    out: dict[str, Any] = {"output_throughput": http}
    if all("offline" in r.extras for r in rounds):
        offline = [r.extras["offline"]["tokens_per_s"] for r in rounds]
        out.update(
            offline_tokens_per_s=offline,
            http_vs_offline=[r.extras["http_vs_offline"] for r in rounds],
            http_vs_offline_median=statistics.median(r.extras["http_vs_offline"] for r in rounds),
            http_vs_offline_best=max(http) / max(offline),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print vLLM's result table (and this engine's extras), write --result-file."""
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    source = TokenSource(tokenizer)
    try:
        requests = build_requests(args, source)
    except (OSError, ValueError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    width = args.max_concurrency or len(requests)
    rng = random.Random(args.seed + 1)  # warm-up prompts of their own: nothing shared with the timed ones
    warmup = [
        BenchRequest(
            source.random_text(rng, WARMUP_PROMPT_LEN) if args.endpoint == "chat" else source.random_ids(rng, WARMUP_PROMPT_LEN),
            WARMUP_PROMPT_LEN,
            WARMUP_OUTPUT_LEN,
        )
        for _ in range(width)
    ]

    try:
        rounds = [run_round(args, requests, warmup, headers, tokenizer) for _ in range(args.repeat)]
    except BenchError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return exc.exit_code
    last = rounds[-1]
    base_url, model, results, metrics, extras = last.base_url, last.model, last.results, last.metrics, last.extras
    if len(rounds) > 1:
        extras["rounds"] = summarize(rounds)
    print(format_report(metrics))
    if "service_steps" in extras:
        print(f"engine steps (EngineStatus): {json.dumps(extras['service_steps'])}")
    print(f"CPU seconds: {json.dumps(extras['cpu_s'])}")
    if "cpus" in extras:
        print(f"CPU placement: {json.dumps(extras['cpus'])}")
    if args.offline:
        print(f"offline (in-process LLM): {json.dumps(extras['offline'])}")
        print(f"HTTP / offline output throughput: {extras['http_vs_offline']:.3f}x")
    if "rounds" in extras:  # the table above is the last round's
        summary = extras["rounds"]
        print(f"rounds, HTTP tok/s: {', '.join(f'{x:.1f}' for x in summary['output_throughput'])}")
        if "http_vs_offline" in summary:
            ratios = ", ".join(f"{x:.3f}x" for x in summary["http_vs_offline"])
            print(
                f"rounds, HTTP / offline: {ratios}; median {summary['http_vs_offline_median']:.3f}x; "
                f"best HTTP / best offline {summary['http_vs_offline_best']:.3f}x"
            )
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"first error of {len(errors)}: {errors[0]}")
    if args.result_file:
        result = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if args.endpoint == "chat" else "openai",
            "base_url": base_url,
            "endpoint": ENDPOINTS[args.endpoint],
            "model_id": model,
            "tokenizer_id": args.tokenizer,
            "dataset": args.dataset,
            "num_prompts": len(requests),
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": 1.0,
            "max_concurrency": args.max_concurrency,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            **metrics,
            **extras,
            "errors": errors,
        }
        if args.save_detailed:  # vLLM's per-request lists (0 / "" for a failed request)
            result.update(
                input_lens=[r.prompt_tokens if r.prompt_tokens is not None else q.prompt_len for q, r in zip(requests, results)],
                output_lens=[output_tokens(r, tokenizer) if r.success else 0 for r in results],
                ttfts=[r.ttft for r in results],
                itls=[r.itl for r in results],
                e2els=[r.latency for r in results],
                generated_texts=[r.text for r in results],
            )
        args.result_file.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
