"""Prometheus metrics of the scheduler, named as vLLM's with a `pagedserve:` prefix and a
`model_name` label, so that dashboards built for vLLM work with the prefix changed.

Two sources:
* the public Generate streams (`StreamMetrics`, one per stream): what clients actually received,
  so `prompt_tokens_total`, `generation_tokens_total` and `request_success_total` count exactly
  what the usage fields and the streamed tokens say, and the latency histograms time the stream;
* the engine, read at scrape time by `EngineCollector` through its operator interface
  (`core_stats`, `executor_statuses`): the queue gauges, KV usage, the core's counters and the
  per-executor series. The scrape runs on prometheus_client's HTTP thread and the engine lives on
  the event loop, so the collector reads it on the loop (`read_on_loop`), between two steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.scheduler.completion import FinishReason
from pagedserve.scheduler.core import SchedulerStats
from pagedserve.scheduler.engine import Engine, ExecutorStatusView
from pagedserve.scheduler.request import Request

PREFIX = "pagedserve:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below 10 ms for inter-token latency
# on fast GPUs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Queue times are mostly far below e2e latencies: the request-latency buckets with finer low ones.
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *REQUEST_LATENCY_BUCKETS)
DEFAULT_MAX_TOKENS_BUCKET = 131_072
# How long a scrape waits for the event loop to take the engine's snapshot.
SCRAPE_TIMEOUT_S = 5.0

T = TypeVar("T")

# Each counter and histogram would otherwise get a `*_created` series (its start time) beside it:
# noise on every dashboard, as vLLM found (it turns them off the same way).
prometheus_client.disable_created_metrics()


def token_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series (1, 2, 5, 10, 20, ...) up to `max_value` (a max_model_len)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def read_on_loop(
    loop: asyncio.AbstractEventLoop, read: Callable[[], T], timeout: float = SCRAPE_TIMEOUT_S
) -> T:
    """`read()` run on `loop` (from any other thread), so that it sees the engine between two of
    its updates, never in the middle of one."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def call() -> None:
        try:
            future.set_result(read())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(exc)

    loop.call_soon_threadsafe(call)
    return future.result(timeout)


@dataclass(frozen=True)
class EngineSnapshot:
    stats: SchedulerStats
    executors: list[ExecutorStatusView]


def engine_snapshot(engine: Engine) -> EngineSnapshot:
    return EngineSnapshot(engine.core_stats(), engine.executor_statuses())


class EngineCollector(Collector):
    """The engine's gauges and counters, read at scrape time (counters from core_stats, which never
    decrease, are exposed as counters)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unknown until scraped: registration must not take a snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        s = snap.stats
        model = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield gauge(
            "num_requests_running", "Requests in execution batches (holding KV blocks).", s.num_running
        )
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out to the CPU pool.", s.num_swapped)
        usage = s.gpu_blocks_in_use / s.num_gpu_blocks if s.num_gpu_blocks else 0.0
        yield gauge("kv_cache_usage_perc", "Fraction of GPU KV blocks in use (0..1).", usage)
        yield counter("num_preemptions", "Preemptions (swap or recompute).", s.num_preemptions)
        yield counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache.", s.prefix_cache_query_tokens
        )
        yield counter("prefix_cache_hits", "Tokens found in the prefix cache.", s.prefix_cache_hit_tokens)
        yield counter(
            "prompt_tokens_computed",
            "Prompt tokens computed by the executors (prefix hits excluded, recomputation included).",
            s.prompt_tokens_computed,
        )
        yield from self._per_executor(snap.executors)

    def _per_executor(self, executors: list[ExecutorStatusView]) -> Iterator[Metric]:
        labels = ["model_name", "executor"]
        families = {
            "attached": GaugeMetricFamily(
                PREFIX + "executor_attached", "1 while the executor is attached.", labels=labels
            ),
            "num_gpu_blocks": GaugeMetricFamily(
                PREFIX + "executor_num_gpu_blocks", "GPU KV blocks of the executor.", labels=labels
            ),
            "gpu_blocks_in_use": GaugeMetricFamily(
                PREFIX + "executor_gpu_blocks_in_use", "GPU KV blocks in use on the executor.", labels=labels
            ),
            "steps": CounterMetricFamily(
                PREFIX + "executor_scheduled_steps",
                "Steps the executor ran for this scheduler (the executor's own executor_steps counts all).",
                labels=labels,
            ),
            "busy_seconds": CounterMetricFamily(
                PREFIX + "executor_step_seconds",
                "Executor wall time of those steps (the sum of step_seconds; / steps = mean step time).",
                labels=labels,
            ),
            "requests_routed": CounterMetricFamily(
                PREFIX + "executor_requests_routed", "Requests placed on the executor.", labels=labels
            ),
        }
        for e in executors:
            values = [self._model_name, e.address]
            for field, family in families.items():
                family.add_metric(values, float(getattr(e, field)))
        yield from families.values()


class SchedulerMetrics:
    """The scheduler's registry: stream-fed counters and histograms plus the engine's collector."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        max_model_len: int | None = None,
        snapshot: Callable[[], EngineSnapshot] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        tokens = token_buckets(max_model_len or DEFAULT_MAX_TOKENS_BUCKET)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of requests that got a first token.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens streamed to clients.", labels, registry=reg
        ).labels(model_name)
        success = Counter(
            PREFIX + "request_success",
            "Requests ended, by finish reason (abort: the stream ended before the request did).",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in ("stop", "length", "abort")
        }
        self.ttft = histogram(
            "time_to_first_token_seconds", "From the Generate call to its first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of a stream.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "From the Generate call to its last message.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "From submission to the first step that scheduled it.",
            QUEUE_TIME_BUCKETS,
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens streamed per request.", tokens
        )
        if snapshot is None:
            snapshot = lambda: engine_snapshot(engine)  # noqa: E731 - same thread as the engine
        reg.register(EngineCollector(snapshot, model_name))

    def stream(self, arrival: float) -> StreamMetrics:
        """The recorder of one Generate stream that arrived at `arrival` (time.monotonic())."""
        return StreamMetrics(self, arrival)


class StreamMetrics:
    """What one Generate stream records: each message as it is sent, then how the stream ended."""

    __slots__ = ("_metrics", "_arrival", "_last", "_num_tokens", "_ended")

    def __init__(self, metrics: SchedulerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None  # when the last token-carrying message went out
        self._num_tokens = 0
        self._ended = False

    def sent(self, num_tokens: int, request: Request) -> None:
        """A message with `num_tokens` tokens is being sent. A message of k tokens (merged deltas,
        --stream-interval) counts as k inter-token gaps of a k-th of the time since the last one."""
        if not num_tokens:
            return
        now = time.monotonic()
        m = self._metrics
        m.generation_tokens.inc(num_tokens)
        self._num_tokens += num_tokens
        gaps = num_tokens
        if self._last is None:
            m.ttft.observe(now - self._arrival)
            m.prompt_tokens.inc(request.num_prompt_tokens)
            gaps -= 1  # the first token has no gap before it; the rest of its message, 0 each
        gap = (now - self._last) / gaps if self._last is not None else 0.0
        for _ in range(gaps):
            m.itl.observe(gap)
        self._last = now

    def ended(self, request: Request, finish_reason: FinishReason | None) -> None:
        """The stream is over: `finish_reason` None means it ended before the request did (client
        gone, deadline passed, executor lost, shutdown) and counts as an abort. Idempotent."""
        if self._ended:
            return
        self._ended = True
        m = self._metrics
        reason = finish_reason.name.lower() if finish_reason is not None else "abort"
        m.request_success[reason].inc()
        m.e2e.observe(time.monotonic() - self._arrival)
        if request.first_scheduled_time is not None:
            m.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        m.request_prompt_tokens.observe(request.num_prompt_tokens)
        m.request_generation_tokens.observe(self._num_tokens)
