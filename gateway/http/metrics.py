"""Prometheus metrics of the whole deployment under vLLM's names, served by every gateway at ``GET /metrics``.

Two sources, both labelled ``model_name`` (the served name):

- *Request-side* series (tokens, finished requests, time to first token, inter-token latency,
  end-to-end and queue time, per-request token counts) are observed by each gateway for the
  requests it serves, as their engine events arrive (`RequestMetrics`, fed by `Generation`);
  Prometheus sums them over gateways. Queue time is known only to the scheduler: it comes with a
  request's first output (`StepOutputs.queue_time_s`).
- *Engine-side* series (running, waiting, KV-cache usage, preemptions, prefix cache, step time,
  dead letters; labelled ``engine`` too) are read at scrape time from each live engine's
  `EngineStatus` as this gateway last read it (`EngineClient.engines`, refreshed every 0.5 s), so
  any gateway shows every engine (`DeploymentCollector`). Each gateway exports the same engine
  series: aggregate them with ``max by (engine)``, not ``sum``. An engine keeps its sums since it
  started; a restarted one starts from 0 again, which Prometheus reads as a counter reset.

Everything lives in one `CollectorRegistry` per app: no module-level state, so several apps in
one process (tests) never share a series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from common.protocol import EngineStatus
from gateway.engine.client import EngineClient
from gateway.engine.handle import EngineEvent

__all__ = ["CONTENT_TYPE_LATEST", "FINISH_REASONS", "DeploymentCollector", "GatewayMetrics", "RequestMetrics"]

# How a request served by a gateway ends (``vllm:request_success``'s ``finished_reason``): vLLM's
# stop, length and abort, plus error (the engine failed it). As in vLLM, a request its client
# abandoned is not counted as finished (`RequestMetrics.finish`): the series stays for dashboards.
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# vLLM ends its 1-2-5 token buckets at max_model_len, which a gateway learns only once an engine
# registers (after its registry is built); this bound covers any context length.
MAX_TOKEN_BUCKET = 1_000_000


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


@dataclass(slots=True)
class ModelSeries:
    """The request-side series of one served model (label lookups done once, not per token)."""

    prompt_tokens: Counter
    generation_tokens: Counter
    success: dict[str, Counter]  # by finish reason
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    queue_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram


class RequestMetrics:
    """One request as the metrics see it: `Generation` feeds it each engine event and the end.

    Tokens count as they reach this gateway from the engine. A stream resumed here replays tokens
    another gateway delivered (and counted): those are not counted again, and its latencies (which
    began elsewhere) are not observed. A resumed stream counts as finished here only if something
    of it came here from its engine: resuming a stream that had already ended counts nothing again.
    """

    __slots__ = (
        "series",
        "num_prompt_tokens",
        "arrival",
        "num_tokens",
        "last_token_at",
        "queue_time_seen",
        "live",
        "done",
    )

    def __init__(self, series: ModelSeries, num_prompt_tokens: int, arrival: float | None) -> None:
        self.series = series
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival  # time.monotonic() when this gateway got the request; None: resumed here
        self.num_tokens = 0  # generated so far, replayed ones included
        self.last_token_at: float | None = None
        self.queue_time_seen = False
        self.live = False  # an event came from the engine to this gateway, not from a journal
        self.done = False

    def on_event(self, event: EngineEvent) -> None:
        """New tokens (possibly none) of this request arrived from its engine."""
        s = self.series
        if event.queue_time_s is not None and not self.queue_time_seen:  # a migrated request brings another
            self.queue_time_seen = True
            s.queue_time.observe(event.queue_time_s)
        n = len(event.token_ids)
        first = self.num_tokens == 0
        self.num_tokens += n
        if not event.replayed:
            self.live = True
        if n == 0 or event.replayed:
            return
        now = time.monotonic()
        # One observation per engine step, as vLLM's. The steps of a merged event (read together)
        # share the wait since the last event; those merged with the first one came with it.
        if self.last_token_at is not None:
            gap = (now - self.last_token_at) / event.num_steps
            for _ in range(event.num_steps):
                s.inter_token_latency.observe(gap)
        else:
            for _ in range(event.num_steps - 1):
                s.inter_token_latency.observe(0.0)
        if self.last_token_at is None and first:  # the prefill is done (vLLM counts prompt tokens then)
            s.prompt_tokens.inc(self.num_prompt_tokens)
            if self.arrival is not None:
                s.time_to_first_token.observe(now - self.arrival)
        self.last_token_at = now
        s.generation_tokens.inc(n)

    def finish(self, reason: str) -> None:
        """The request ended (``reason`` one of `FINISH_REASONS`); only the first call counts.

        Not counted, as in vLLM: a request its client abandoned (``abort``; a resumable stream may
        yet be resumed and end elsewhere), and a resumed stream all of which was replayed from its
        journal (the gateway that delivered its end counted it)."""
        if self.done:
            return
        self.done = True
        if reason == "abort" or (self.arrival is None and not self.live):
            return
        s = self.series
        s.success[reason].inc()
        if self.arrival is not None:
            s.e2e_latency.observe(time.monotonic() - self.arrival)
        s.request_prompt_tokens.observe(self.num_prompt_tokens)
        s.request_generation_tokens.observe(self.num_tokens)


class DeploymentCollector(Collector):
    """Engine-side series from the engines' `EngineStatus`, and this gateway's own, at scrape time."""

    def __init__(self, client: EngineClient, served_name: Callable[[EngineStatus], str], default_name: str) -> None:
        self.client = client
        self.served_name = served_name
        self.default_name = default_name  # the model name before any engine has registered

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=labels)
        kv_usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=labels
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", labels=labels
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels=labels
        )
        step = SummaryMetricFamily(
            "conveyor:engine_step_seconds",
            "Engine steps: wall time per step in the scheduler (schedule, executor round trip, outputs).",
            labels=labels,
        )
        forward = SummaryMetricFamily(
            "conveyor:engine_step_forward_seconds", "Engine steps: the executor's forward-pass time per step.", labels=labels
        )
        dead = CounterMetricFamily(
            "conveyor:dead_letters", "Malformed messages an engine's scheduler rejected to the dead-letter stream.", labels=labels
        )
        for sid, status in sorted(self.client.engines.items()):
            values = [self.served_name(status), sid]
            running.add_metric(values, status.num_running)
            waiting.add_metric(values, status.num_waiting)
            kv_usage.add_metric(values, 1 - status.num_free_blocks / status.num_blocks if status.num_blocks else 0.0)
            preemptions.add_metric(values, status.num_preemptions)
            queries.add_metric(values, status.prefix_cache_queries)
            hits.add_metric(values, status.prefix_cache_hits)
            step.add_metric(values, count_value=status.step_count, sum_value=status.step_wall_s)
            forward.add_metric(values, count_value=status.step_count, sum_value=status.step_forward_s)
            dead.add_metric(values, status.num_dead_letters)
        yield from (running, waiting, kv_usage, preemptions, queries, hits, step, forward, dead)

        info = self.client.model_info
        own = [self.served_name(info) if info is not None else self.default_name]
        migrations = CounterMetricFamily(
            "conveyor:migrations",
            "Requests this gateway moved to another engine (theirs died or restarted).",
            labels=["model_name"],
        )
        migrations.add_metric(own, self.client.num_migrations)
        gateway_dead = CounterMetricFamily(
            "conveyor:gateway_dead_letters",
            "Malformed messages this gateway rejected to the dead-letter stream.",
            labels=["model_name"],
        )
        gateway_dead.add_metric(own, self.client.transport.num_dead_letters)
        yield from (migrations, gateway_dead)
        if self.client.redis_rtt_s is not None:
            rtt = GaugeMetricFamily(
                "conveyor:redis_rtt_seconds",
                "Round-trip time of this gateway's last Redis command of its engine refresh (every 0.5 s).",
                labels=["model_name"],
            )
            rtt.add_metric(own, self.client.redis_rtt_s)
            yield rtt


class GatewayMetrics:
    """One gateway app's registry: the request-side series and the `DeploymentCollector`."""

    def __init__(self, client: EngineClient, served_name: Callable[[EngineStatus], str], default_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        token_buckets = build_1_2_5_buckets(MAX_TOKEN_BUCKET)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, buckets=token_buckets, registry=r
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", labels, buckets=token_buckets, registry=r
        )
        self.registry.register(DeploymentCollector(client, served_name, default_name))
        self._series: dict[str, ModelSeries] = {}

    def series(self, model_name: str) -> ModelSeries:
        """The series of ``model_name``, created (at 0, so they show before any request) on first use."""
        found = self._series.get(model_name)
        if found is None:
            found = self._series[model_name] = ModelSeries(
                self.prompt_tokens.labels(model_name),
                self.generation_tokens.labels(model_name),
                {reason: self.request_success.labels(model_name, reason) for reason in FINISH_REASONS},
                self.time_to_first_token.labels(model_name),
                self.inter_token_latency.labels(model_name),
                self.e2e_latency.labels(model_name),
                self.queue_time.labels(model_name),
                self.request_prompt_tokens.labels(model_name),
                self.request_generation_tokens.labels(model_name),
            )
        return found

    def request(self, model_name: str, num_prompt_tokens: int, arrival: float | None) -> RequestMetrics:
        """A new `RequestMetrics` (``arrival``: `time.monotonic()` when the request came in; None for a
        stream resumed here)."""
        return RequestMetrics(self.series(model_name), num_prompt_tokens, arrival)

    def exposition(self) -> bytes:
        """Every series in Prometheus's text format (`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)
