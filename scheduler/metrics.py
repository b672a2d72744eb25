"""Prometheus metrics of the scheduler, named as vLLM's with a `pagedserve:` prefix and a
`model_name` label, so that dashboards built for vLLM work with the prefix changed.

Two sources:
* the public Generate streams (`StreamMetrics`, one per stream): what clients actually received,
  so `prompt_tokens_total`, `generation_tokens_total` and `request_success_total` count exactly
  what the usage fields and the streamed tokens say, and the latency histograms time the stream.
  They are plain numbers (`StreamCounts`, `LoopHistogram`) that only the event loop writes:
  recording a message costs ~1.3 us, against ~4-6 us through prometheus_client's own counter and
  histogram (a lock each, and a linear search of the buckets), measured on this project's shared
  2-core CPU machine, where streaming a message costs ~15 us in all;
* the engine, read at scrape time by `SchedulerCollector` through its operator interface
  (`core_stats`, `executor_statuses`): the queue gauges, KV usage, the core's counters and the
  per-executor series.
The scrape runs on prometheus_client's HTTP thread and both sources live on the event loop, so the
collector takes its snapshot on the loop (`read_on_loop`), between two steps.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
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


class LoopHistogram:
    """A histogram's counts as plain numbers, written by one thread (the event loop)."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times  # le is inclusive
        self.sum += value * times

    def family(self, name: str, doc: str, model: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(float(bound)), cumulative))
        family.add_metric(model, buckets, sum_value=self.sum)
        return family


@dataclass
class StreamCounts:
    """Everything the Generate streams record; only the event loop writes it."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("stop", "length", "abort"), 0)
    )
    ttft: LoopHistogram = field(default_factory=lambda: LoopHistogram(TTFT_BUCKETS))
    itl: LoopHistogram = field(default_factory=lambda: LoopHistogram(ITL_BUCKETS))
    e2e: LoopHistogram = field(default_factory=lambda: LoopHistogram(REQUEST_LATENCY_BUCKETS))
    queue_time: LoopHistogram = field(default_factory=lambda: LoopHistogram(QUEUE_TIME_BUCKETS))
    request_prompt_tokens: LoopHistogram = field(default_factory=lambda: LoopHistogram(token_buckets(1)))
    request_generation_tokens: LoopHistogram = field(default_factory=lambda: LoopHistogram(token_buckets(1)))


@dataclass(frozen=True)
class Snapshot:
    """What one scrape shows, taken at one moment on the event loop."""

    stats: SchedulerStats
    executors: list[ExecutorStatusView]
    streams: StreamCounts


class SchedulerCollector(Collector):
    """Every scheduler series, from one snapshot per scrape. Counters from core_stats (which never
    decrease) are exposed as counters."""

    def __init__(self, snapshot: Callable[[], Snapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())  # registration must not take a snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        s, streams = snap.stats, snap.streams
        model = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        yield counter(
            "prompt_tokens", "Prompt tokens of requests that got a first token.", streams.prompt_tokens
        )
        yield counter("generation_tokens", "Tokens streamed to clients.", streams.generation_tokens)
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Requests ended, by finish reason (abort: the stream ended before the request did).",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in streams.request_success.items():
            success.add_metric([self._model_name, reason], count)
        yield success
        histograms = (
            ("time_to_first_token_seconds", "From the Generate call to its first token.", streams.ttft),
            ("inter_token_latency_seconds", "Between consecutive tokens of a stream.", streams.itl),
            ("e2e_request_latency_seconds", "From the Generate call to its last message.", streams.e2e),
            (
                "request_queue_time_seconds",
                "From submission to the first step that scheduled the request.",
                streams.queue_time,
            ),
            ("request_prompt_tokens", "Prompt tokens per request.", streams.request_prompt_tokens),
            ("request_generation_tokens", "Tokens streamed per request.", streams.request_generation_tokens),
        )
        for name, doc, histogram in histograms:
            yield histogram.family(name, doc, model)

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
        yield counter(
            "cpu_prefix_cache_hits",
            "Of the prefix-cache hits, tokens loaded from the CPU tier (--kv-offloading-size).",
            s.cpu_prefix_cache_hit_tokens,
        )
        yield gauge("cpu_tier_blocks", "KV blocks the prefix cache's CPU tiers hold.", s.cpu_tier_blocks)
        yield gauge(
            "cpu_tier_capacity_blocks", "KV blocks the CPU tiers may hold.", s.cpu_tier_capacity_blocks
        )
        yield gauge(
            "disk_tier_blocks", "KV blocks the disk tiers below the CPU tiers hold.", s.disk_tier_blocks
        )
        yield gauge(
            "disk_tier_capacity_blocks", "KV blocks the disk tiers may hold.", s.disk_tier_capacity_blocks
        )
        moved = CounterMetricFamily(
            PREFIX + "kv_offload_bytes",
            "KV bytes copied between the GPU pools, the CPU tiers and the disk tiers, by direction.",
            labels=["model_name", "direction"],
        )
        for direction, name in (
            ("gpu_to_cpu", "kv_offloaded_bytes"),
            ("cpu_to_gpu", "kv_loaded_bytes"),
            ("cpu_to_disk", "kv_spilled_bytes"),
            ("disk_to_cpu", "kv_fetched_bytes"),
        ):
            moved.add_metric([self._model_name, direction], sum(getattr(e, name) for e in snap.executors))
        yield moved
        # Speculative decoding (--speculative-config), vLLM's names: acceptance rate = accepted /
        # draft tokens, mean accepted length = 1 + accepted / drafts.
        yield counter(
            "spec_decode_num_drafts", "Verifications: one per request per step with proposals.", s.spec_steps
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified by the target.", s.spec_draft_tokens
        )
        accepted = s.spec_accepted_tokens
        yield counter("spec_decode_num_accepted_tokens", "Of the proposed tokens, those accepted.", accepted)
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposals by their position in the proposal (0: the first).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(s.spec_accepted_per_pos or ()):
            per_pos.add_metric([self._model_name, str(position)], count)
        yield per_pos
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
            for name, family in families.items():
                family.add_metric(values, float(getattr(e, name)))
        yield from families.values()


class SchedulerMetrics:
    """The scheduler's registry: what the streams record (`streams`) and the engine's state, both
    read by one collector at scrape time.

    Args:
        engine: read through its operator interface (core_stats, executor_statuses).
        model_name: the `model_name` label.
        max_model_len: the top of the token-count histograms' buckets.
        on_loop: runs a read on the event loop and returns its result (`read_on_loop`), when the
            registry is scraped from another thread; None: scrapes run on the loop's own thread.
    """

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        max_model_len: int | None = None,
        on_loop: Callable[[Callable[[], Snapshot]], Snapshot] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        tokens = token_buckets(max_model_len or DEFAULT_MAX_TOKENS_BUCKET)
        self.streams = StreamCounts(
            request_prompt_tokens=LoopHistogram(tokens), request_generation_tokens=LoopHistogram(tokens)
        )
        self.registry = CollectorRegistry()
        snapshot = self.snapshot if on_loop is None else lambda: on_loop(self.snapshot)
        self.registry.register(SchedulerCollector(snapshot, model_name))

    def snapshot(self) -> Snapshot:
        """Everything a scrape shows; call it on the event loop."""
        return Snapshot(
            self.engine.core_stats(), self.engine.executor_statuses(), copy.deepcopy(self.streams)
        )

    def stream(self, arrival: float) -> StreamMetrics:
        """The recorder of one Generate stream that arrived at `arrival` (time.monotonic())."""
        return StreamMetrics(self.streams, arrival)


class StreamMetrics:
    """What one Generate stream records: each message as it is sent, then how the stream ended."""

    __slots__ = ("_counts", "_arrival", "_last", "_num_tokens", "_ended", "first_token_time")

    def __init__(self, counts: StreamCounts, arrival: float) -> None:
        self._counts = counts
        self._arrival = arrival
        self._last: float | None = None  # when the last token-carrying message went out
        self._num_tokens = 0
        self._ended = False
        self.first_token_time: float | None = None  # time.monotonic() of the first token sent

    def sent(self, num_tokens: int, request: Request) -> None:
        """A message with `num_tokens` tokens is being sent. A message of k tokens (merged deltas,
        --stream-interval) counts as k inter-token gaps of a k-th of the time since the last one;
        the tokens sharing the first message, as gaps of 0."""
        if not num_tokens:
            return
        now = time.monotonic()
        counts = self._counts
        counts.generation_tokens += num_tokens
        self._num_tokens += num_tokens
        if self._last is None:
            self.first_token_time = now
            counts.ttft.observe(now - self._arrival)
            counts.prompt_tokens += request.num_prompt_tokens
            if num_tokens > 1:
                counts.itl.observe(0.0, num_tokens - 1)
        else:
            counts.itl.observe((now - self._last) / num_tokens, num_tokens)
        self._last = now

    def ended(self, request: Request, finish_reason: FinishReason | None) -> None:
        """The stream is over: `finish_reason` None means it ended before the request did (client
        gone, deadline passed, executor lost, shutdown) and counts as an abort. Idempotent."""
        if self._ended:
            return
        self._ended = True
        counts = self._counts
        counts.request_success[finish_reason.name.lower() if finish_reason is not None else "abort"] += 1
        counts.e2e.observe(time.monotonic() - self._arrival)
        if request.first_scheduled_time is not None:
            counts.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        counts.request_prompt_tokens.observe(request.num_prompt_tokens)
        counts.request_generation_tokens.observe(self._num_tokens)
