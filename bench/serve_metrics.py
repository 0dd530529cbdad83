"""`conveyor bench serve`'s results: what the client saw of each request, and vLLM's result fields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.serve_data import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one streamed request (seconds from the moment it was sent)."""

    success: bool = False
    ttft: float = 0.0  # to the first chunk that carries output
    itl: list[float] = field(default_factory=list)  # gaps between consecutive output chunks
    latency: float = 0.0  # to the end of the stream
    prompt_tokens: int | None = None  # the server's usage, when it sent one
    output_tokens: int | None = None
    chunks: int = 0  # output chunks: the output count of last resort
    text: str = ""
    error: str = ""


# -- metrics -----------------------------------------------------------------------------------
def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    # As vLLM: an empty series reports 0; seconds in, ms out; p99 interpolated linearly.
    arr = np.asarray(values or [0.0], dtype=float) * 1e3
    return {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(arr.std()),
        f"p99_{name}_ms": float(np.percentile(arr, 99)),
    }


def output_tokens(result: RequestResult, tokenizer: Any = None) -> int:
    """The server's completion count; else the tokenizer's count of the text; else the chunks."""
    if result.output_tokens is not None:
        return result.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(result.text, add_special_tokens=False))
    return result.chunks


def compute_metrics(
    requests: Sequence[BenchRequest], results: Sequence[RequestResult], duration: float, tokenizer: Any = None
) -> dict[str, Any]:
    """vLLM's ``benchmark_serving`` metrics over the successful requests (failures only counted)."""
    ttfts, tpots, itls, e2els = [], [], [], []
    total_in = total_out = completed = chunks = 0
    for request, r in zip(requests, results):
        if not r.success:
            continue
        completed += 1
        chunks += r.chunks
        n_out = output_tokens(r, tokenizer)
        total_out += n_out
        total_in += r.prompt_tokens if r.prompt_tokens is not None else (request.prompt_len or 0)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls += r.itl
        if n_out > 1:  # TPOT excludes the first token; one-token requests have none
            tpots.append((r.latency - r.ttft) / (n_out - 1))
    dur = max(duration, 1e-9)
    return {
        "completed": completed,
        "failed": len(results) - completed,
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        # Not one of vLLM's fields: fewer chunks than tokens means the server merged steps.
        "total_output_chunks": chunks,
        "request_throughput": completed / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        **_stats("ttft", ttfts),
        **_stats("tpot", tpots),
        **_stats("itl", itls),
        **_stats("e2el", e2els),
    }


def format_report(metrics: dict[str, Any]) -> str:
    """vLLM's result table."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", metrics["completed"]),
        ("Failed requests:", metrics["failed"]),
        ("Benchmark duration (s):", f"{metrics['duration']:.2f}"),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Total generated tokens:", metrics["total_output_tokens"]),
        ("Total output chunks:", metrics["total_output_chunks"]),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40} {v:<10}" for k, v in rows]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        name = key.upper()
        lines += [
            f"{f'{label} {name} (ms):':<40} {metrics[f'{stat}_{key}_ms']:<10.2f}"
            for label, stat in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))
        ]
    lines.append("=" * 50)
    return "\n".join(lines)


def is_output_chunk(chunk: dict[str, Any]) -> bool:
    """Whether an SSE chunk carries output. Our chat stream opens with a role-only chunk before any
    token exists (vLLM's arrives with the first token): it must not count as the first token."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    content = choice.get("text") if "delta" not in choice else (choice.get("delta") or {}).get("content")
    return bool(content) or choice.get("finish_reason") is not None or bool(choice.get("logprobs"))
