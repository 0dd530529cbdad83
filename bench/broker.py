"""`conveyor bench broker`: what the broker (Redis) does per generated token and per request.

    python -m bench.broker                                  # a tiny model, this checkout's code
    python -m bench.broker --baseline main --stream-interval-ms 0 --stream-interval-ms 50
    python -m bench.broker --model DIR --requests 16 --max-tokens 128 --json out.json

Starts a stack (one engine, one gateway) per variant, each on a private ``redis-server`` of its
own, so that nothing else counts, and sends four workloads over HTTP: streaming and not, ``n`` = 1 and 4, each a burst
of ``--requests`` completions of ``--max-tokens`` tokens (``ignore_eos``). Around each workload it
reads Redis's ``INFO`` (commandstats, ``total_net_input_bytes`` / ``total_net_output_bytes``,
``used_cpu_user + used_cpu_sys``) and every stream's ``entries-added`` (XINFO STREAM), and reports
the deltas per generated token and per request, by command and by stream kind (steps, results,
outputs, journal, requests). What the stack does while idle (heartbeats, status keys, blocking
reads timing out) is measured over ``--idle-s`` first and subtracted at its rate.

Commands count every command Redis ran, those a script (EVALSHA) runs included: the work Redis
does, not the round trips clients make.

``--baseline REV`` adds a stack whose services run that git revision (``git archive``: the
benchmark's own code stays this checkout's), so a change is measured against what it replaces in
the same run. Each ``--stream-interval-ms`` value is one more stack of this checkout, its gateway
started with that flag (none given: one stack without the flag). The stacks run side by side and
take each workload in turn, so a shared machine's load falls on every variant alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from common.config import ServiceDefaults
from infra.stack import REPO, Stack

# INFO fields: bytes Redis read and wrote on its client connections, its CPU seconds.
NET_IN, NET_OUT = "total_net_input_bytes", "total_net_output_bytes"
CPU_FIELDS = ("used_cpu_user", "used_cpu_sys")
# What the benchmark itself sends to read the counters: not the stack's cost.
OWN_COMMANDS = frozenset({"info", "scan", "xinfo|stream", "xinfo", "type", "ping", "client|setinfo", "client|setname"})
PROMPT_LEN = 16


@dataclass(slots=True)
class Workload:
    """A burst of identical completions requests, all sent at once."""

    name: str
    stream: bool
    n: int


WORKLOADS = (
    Workload("stream n=1", True, 1),
    Workload("stream n=4", True, 4),
    Workload("plain n=1", False, 1),
    Workload("plain n=4", False, 4),
)


@dataclass(slots=True)
class Counters:
    """Redis's cumulative counters at one moment."""

    at: float
    calls: dict[str, int]  # by command (lower case; "xinfo|stream" for subcommands)
    net_in: int
    net_out: int
    cpu_s: float
    entries: dict[str, int]  # stream entries ever added, by stream kind

    def minus(self, earlier: Counters) -> Counters:
        """The counts between ``earlier`` and this snapshot (``at``: the seconds between)."""

        def diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            """``a - b`` per key, the keys that differ only."""
            return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}

        return Counters(
            self.at - earlier.at,
            diff(self.calls, earlier.calls),
            self.net_in - earlier.net_in,
            self.net_out - earlier.net_out,
            self.cpu_s - earlier.cpu_s,
            diff(self.entries, earlier.entries),
        )

    def less_idle(self, idle: Counters) -> Counters:
        """These counts less what an idle stack does in as long (``idle``: an idle interval's)."""
        scale = self.at / idle.at if idle.at > 0 else 0.0

        def net(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            """``a`` less ``b`` scaled to ``a``'s interval, the keys left positive only."""
            out = {k: round(v - scale * b.get(k, 0)) for k, v in a.items()}
            return {k: v for k, v in out.items() if v > 0}

        return Counters(
            self.at,
            net(self.calls, idle.calls),
            max(0, round(self.net_in - scale * idle.net_in)),
            max(0, round(self.net_out - scale * idle.net_out)),
            max(0.0, self.cpu_s - scale * idle.cpu_s),
            net(self.entries, idle.entries),
        )


def stream_kind(key: str, namespace: str) -> str:
    """``steps`` for ``<namespace>:steps:0``: the kind of a stream, by its name (`common.protocol.Names`)."""
    return key.removeprefix(f"{namespace}:").split(":", 1)[0]


def read_counters(client: redis.Redis, namespace: str) -> Counters:
    """Redis's counters now, and the entries ever added to each kind of stream of ``namespace``."""
    entries: dict[str, int] = {}
    for key in client.scan_iter(match=f"{namespace}:*", count=1000, _type="stream"):
        name = key.decode() if isinstance(key, bytes) else str(key)
        try:
            added = int(client.xinfo_stream(name).get("entries-added", 0))
        except redis.ResponseError:  # expired meanwhile
            continue
        kind = stream_kind(name, namespace)
        entries[kind] = entries.get(kind, 0) + added
    info = client.info("everything")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_")}
    cpu = sum(float(info[f]) for f in CPU_FIELDS)
    return Counters(time.monotonic(), calls, int(info[NET_IN]), int(info[NET_OUT]), cpu, entries)


@dataclass(slots=True)
class Result:
    """One workload's cost on one stack."""

    variant: str
    workload: str
    requests: int
    tokens: int
    seconds: float
    cost: Counters
    failed: int = 0
    per: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Per-token and per-request figures, and the breakdowns (per token)."""
        c, t, r = self.cost, max(1, self.tokens), max(1, self.requests)
        commands = sum(v for k, v in c.calls.items() if k not in OWN_COMMANDS)
        return {
            "variant": self.variant,
            "workload": self.workload,
            "requests": self.requests,
            "failed": self.failed,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "commands_per_token": round(commands / t, 3),
            "commands_per_request": round(commands / r, 1),
            "bytes_in_per_token": round(c.net_in / t, 1),
            "bytes_out_per_token": round(c.net_out / t, 1),
            "bytes_per_request": round((c.net_in + c.net_out) / r),
            "cpu_us_per_token": round(1e6 * c.cpu_s / t, 2),
            "cpu_ms_per_request": round(1e3 * c.cpu_s / r, 3),
            # Per engine step (an entry of the steps stream): what does not grow with the batch.
            "commands_per_step": round(commands / max(1, c.entries.get("steps", 0)), 2),
            "by_command_per_token": {
                k: round(v / t, 3) for k, v in sorted(c.calls.items(), key=lambda kv: -kv[1]) if k not in OWN_COMMANDS
            },
            "entries_per_token": {k: round(v / t, 3) for k, v in sorted(c.entries.items(), key=lambda kv: -kv[1])},
        }


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    """Send one request; the tokens it generated (-1: it failed)."""
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            return -1
        if not body["stream"]:
            return int((await reply.json())["usage"]["completion_tokens"])
        tokens = -1
        async for line in reply.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
        return tokens


async def send_burst(base_url: str, model: str, workload: Workload, requests: int, max_tokens: int) -> list[int]:
    """``requests`` completions at once; each one's generated tokens (-1: failed)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(range(100, 100 + PROMPT_LEN)),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "n": workload.n,
        "stream": workload.stream,
    }
    if workload.stream:
        body["stream_options"] = {"include_usage": True}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        url = f"{base_url}/v1/completions"
        return list(await asyncio.gather(*(_one(session, url, body) for _ in range(requests))))


def served_name(base_url: str) -> str:
    """The model name the gateway serves."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


@dataclass(slots=True)
class Variant:
    """One stack to measure: whose code it runs, and its gateway's extra flags."""

    label: str
    repo: Path
    gateway_args: tuple[str, ...] = ()


def start(variant: Variant, model: str) -> Stack:
    """``variant``'s stack, on a private Redis of its own."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    stack = Stack(
        model,
        workdir,
        private_redis=True,
        repo=variant.repo,
        gateway_args=variant.gateway_args,
        heartbeat_ttl_ms=ServiceDefaults.heartbeat_ttl_ms,
    )
    return stack.start()


def measure(variants: list[Variant], model: str, workloads: list[Workload], args: argparse.Namespace) -> list[Result]:
    """Start every variant's stack, measure each idle, then each workload on each stack in turn
    (a shared machine's load then falls on every variant alike)."""
    stacks: list[Stack] = []
    results = []
    try:
        for variant in variants:
            stacks.append(start(variant, model))
        names, idles = [], []
        for stack in stacks:
            names.append(served_name(stack.urls[0]))
            asyncio.run(send_burst(stack.urls[0], names[-1], Workload("warm-up", True, 1), 2, 4))
        time.sleep(0.5)
        for stack in stacks:
            first = read_counters(stack.redis, stack.namespace)
            time.sleep(args.idle_s)
            idles.append(read_counters(stack.redis, stack.namespace).minus(first))
        for workload in [w for _ in range(args.repeat) for w in workloads]:
            for variant, stack, name, idle in zip(variants, stacks, names, idles, strict=True):
                before = read_counters(stack.redis, stack.namespace)
                t0 = time.monotonic()
                tokens = asyncio.run(send_burst(stack.urls[0], name, workload, args.requests, args.max_tokens))
                seconds = time.monotonic() - t0
                cost = read_counters(stack.redis, stack.namespace).minus(before).less_idle(idle)
                ok = [t for t in tokens if t >= 0]
                result = Result(variant.label, workload.name, len(ok), sum(ok), seconds, cost, failed=len(tokens) - len(ok))
                results.append(result)
                print(format_row(result.summary()), file=sys.stderr, flush=True)
    except BaseException:
        for stack in stacks:
            print(stack.logs(), file=sys.stderr)
        raise
    finally:
        for stack in stacks:
            stack.stop()
    return results


def checkout(rev: str, into: Path) -> Path:
    """The tree of git revision ``rev`` of this repository, written under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


HEADER = (
    f"{'variant':<16} {'workload':<11} {'tok':>5} {'cmd/tok':>8} {'cmd/req':>8} {'B in/tok':>9} {'B out/tok':>9} "
    f"{'cpu us/tok':>10}  top commands per token"
)


def format_row(s: dict[str, Any]) -> str:
    """One line of the report."""
    top = " ".join(f"{k}={v}" for k, v in list(s["by_command_per_token"].items())[:6])
    return (
        f"{s['variant']:<16} {s['workload']:<11} {s['tokens']:>5} {s['commands_per_token']:>8} {s['commands_per_request']:>8} "
        f"{s['bytes_in_per_token']:>9} {s['bytes_out_per_token']:>9} {s['cpu_us_per_token']:>10}  {top}"
    )


def format_report(summaries: list[dict[str, Any]]) -> str:
    """The table of every workload on every variant, then the stream entries per token."""
    lines = [HEADER, *(format_row(s) for s in summaries), "", "stream entries per token (XADDs, by stream kind):"]
    for s in summaries:
        kinds = " ".join(f"{k}={v}" for k, v in s["entries_per_token"].items())
        lines.append(f"{s['variant']:<16} {s['workload']:<11} {kinds}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options (``--help`` lists them)."""
    p = argparse.ArgumentParser(prog="python -m bench.broker", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random llama)")
    p.add_argument("--requests", type=int, default=16, help="requests per workload, sent at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="run every workload this many times (a row each)")
    p.add_argument("--idle-s", type=float, default=2.0, help="seconds the idle stack is measured for")
    p.add_argument("--baseline", default=None, metavar="REV", help="also measure this git revision first (e.g. main)")
    p.add_argument(
        "--stream-interval-ms",
        type=int,
        action="append",
        default=[],
        help="one stack of this checkout per value, its gateway started with this flag (repeatable)",
    )
    p.add_argument("--workload", action="append", choices=[w.name for w in WORKLOADS], help="default: all four")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure every workload on each stack asked for and print the table (module docstring)."""
    args = parse_args(argv)
    workloads = [w for w in WORKLOADS if not args.workload or w.name in args.workload]
    scratch = Path(tempfile.mkdtemp(prefix="bench-broker-code-"))
    model = args.model
    if model is None:
        from executor.make_model import make_model

        model = str(make_model("llama", "tiny", 0, scratch / "model"))
    variants: list[Variant] = []
    if args.baseline:
        variants.append(Variant(args.baseline, checkout(args.baseline, scratch / "baseline")))
    for interval in args.stream_interval_ms or [None]:
        if interval is None:
            variants.append(Variant("this", REPO))
        else:
            variants.append(Variant(f"this {interval}ms", REPO, ("--stream-interval-ms", str(interval))))
    print(HEADER, file=sys.stderr)
    results = measure(variants, model, workloads, args)
    summaries = [r.summary() for v in variants for r in results if r.variant == v.label]
    print(format_report(summaries))
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "results": summaries}, indent=1))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
