"""The load client of `conveyor bench serve`: streaming requests over aiohttp, timed per SSE chunk.

aiohttp, as vLLM's benchmark: httpx's pool hands reused connections to a burst so slowly that it
measured itself (docs/performance.md). The client shares the server's CPUs on one machine, so it
reads whatever each socket read brings (`SseEvents`) and runs on uvloop where installed.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from bench.serve_data import BenchRequest, arrival_delays
from bench.serve_metrics import RequestResult, is_output_chunk

T = TypeVar("T")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(RuntimeError):
    """The benchmark cannot run as asked: no model served, or every warm-up request failed (a
    wrong URL, model or key rather than a load to measure); ``exit_code`` is the command's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def request_body(endpoint: str, model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """A streaming, greedy request body with usage in the stream."""
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        content = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body.update(messages=[{"role": "user", "content": content}], max_completion_tokens=max_tokens)
    else:
        body.update(prompt=prompt, max_tokens=max_tokens)
    if ignore_eos:  # not an OpenAI parameter: sent only when asked for
        body["ignore_eos"] = True
    return body


async def send_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> RequestResult:
    """Stream one request and time its chunks; any failure comes back as ``success=False``."""
    result = RequestResult()
    start = time.perf_counter()
    events = SseEvents(result, start)
    received = False  # any byte of a response: a request is sent again only before one
    try:
        for attempt in (1, 2):
            try:
                async with session.post(url, json=body) as response:
                    if response.status != 200:
                        detail = (await response.read()).decode(errors="replace")[:300]
                        result.error = f"HTTP {response.status}: {detail}"
                        return result
                    # Whatever arrived, not line by line: the events of one read share their arrival
                    # time, and the client pays one await per read instead of three per event.
                    async for data in response.content.iter_any():
                        received = True
                        events.feed(data, time.perf_counter())
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # A kept-alive connection the server closed while it idled (llama-server closes them
                # after 5 s) fails before a byte of the response: HTTP clients send the request
                # again on a new connection, once; the time lost stays in the request's.
                if attempt == 2 or received:
                    raise
        if result.error:
            return result
        result.latency = (events.done_at or time.perf_counter()) - start
        if result.chunks == 0:
            result.ttft = result.latency
        result.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


class SseEvents:
    """An SSE body fed as it arrives, into one request's `RequestResult` (timed from ``start``)."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self.last = start
        self.done_at = 0.0
        self.rest = b""  # an event not yet ended by its blank line

    def feed(self, data: bytes, now: float) -> None:
        """Take the bytes of one read (arrived at ``now``)."""
        buf = self.rest + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *complete, self.rest = buf.split(b"\n\n")
        for event in complete:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.on_data(line[5:].strip(), now)

    def on_data(self, data: bytes, now: float) -> None:
        # Read to the end, past [DONE] or an error: a response left unread closes its
        # connection, and the timed run would open new ones instead of reusing the warm-up's.
        result = self.result
        if self.done_at or result.error:
            return
        if data == b"[DONE]":
            self.done_at = now
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            error = chunk["error"]
            result.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        if is_output_chunk(chunk):
            if result.chunks == 0:
                result.ttft = now - self.last  # ``last`` is still the start
            else:
                result.itl.append(now - self.last)
            self.last = now
            result.chunks += 1
            choice = chunk["choices"][0]
            piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            result.text += piece or ""
        if usage := chunk.get("usage"):
            result.prompt_tokens = usage.get("prompt_tokens")
            result.output_tokens = usage.get("completion_tokens")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed: the load client shares the server's CPUs
    here, and every cycle it spends is one the server under test does not get (with `SseEvents`,
    the client's CPU for one 256-request load fell from 2.73 / 2.24 s to 2.02 / 1.75 s)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def run_load(
    base_url: str,
    endpoint: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    ignore_eos: bool,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    warmup: Sequence[BenchRequest] = (),
    headers: dict[str, str] | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Warm up with one burst of ``warmup`` at once, then send ``requests`` (Poisson arrivals at
    ``request_rate``, at most ``max_concurrency`` in flight). Returns the results in request
    order and the timed duration (first send to last completion); `BenchError` if no warm-up
    request succeeded."""
    from tqdm import tqdm

    url = base_url + ENDPOINTS[endpoint]
    width = max_concurrency or len(requests)
    sem = asyncio.Semaphore(width)
    delays = arrival_delays(len(requests), request_rate, seed)
    # aiohttp, as vLLM's benchmark: httpx's pool hands reused connections to a burst so slowly that it
    # measured itself (docs/performance.md). Lines up to 10 MiB: chunks with many top logprobs are long.
    # Idle connections are closed after 4 s, before the servers' own 5 s (uvicorn's, llama-server's)
    # can close one under a request that reuses it.
    connector = aiohttp.TCPConnector(limit=width + 8, keepalive_timeout=4)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers, read_bufsize=10 << 20) as client:
        # One burst of short requests at the full concurrency opens the connections and wakes the
        # server's worker threads, so the timed run does not pay for them.
        warm = await asyncio.gather(
            *(send_request(client, url, request_body(endpoint, model, r.prompt, r.output_len, ignore_eos)) for r in warmup)
        )
        if warm and not any(r.success for r in warm):
            raise BenchError(f"every warm-up request failed, e.g. {warm[0].error}")
        bar = tqdm(total=len(requests), disable=not progress, desc="requests")

        async def one(r: BenchRequest) -> RequestResult:
            async with sem:
                out = await send_request(client, url, request_body(endpoint, model, r.prompt, r.output_len, ignore_eos))
            bar.update(1)
            return out

        tasks = []
        start = time.perf_counter()
        for r, delay in zip(requests, delays):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(r)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return results, duration
