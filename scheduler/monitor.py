"""What the scheduler tells its operators while it runs: standard gRPC health (grpc.health.v1) that
follows the engine, a periodic stats line while it works, and a warning when preemption is frequent.

Health is SERVING only while the engine has an executor attached and the scheduler is not draining,
so load balancers and Kubernetes probes route around a scheduler that cannot serve. A watcher task
polls the engine every `WATCH_PERIOD_S` (the engine has no event for it, and one attribute read a
period costs nothing) and publishes changes, so `Health/Watch` streams see each transition.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import structlog
from grpc_health.v1 import health, health_pb2

from pagedserve.protos import wire
from pagedserve.scheduler.core import SchedulerStats
from pagedserve.scheduler.engine import Engine

log = structlog.get_logger()

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICES = ("", wire.SCHEDULER_HEALTH_SERVICE)  # the whole server, and Generation by name
WATCH_PERIOD_S = 0.2
# Preemption is the engine's answer to KV memory running out; now and then it is fine, but a steady
# stream of them means the batch does not fit (recomputed prompts, stalled streams).
PREEMPTION_WARNING_THRESHOLD = 10  # more preemptions than this within the window: warn
PREEMPTION_WINDOW_S = 60.0
PREEMPTION_WARNING_PERIOD_S = 60.0  # at most one warning per period
STATS_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class _StatsSample:
    time: float
    steps: int
    tokens_generated: int
    prompt_tokens_computed: int


class StatsLog:
    """One "scheduler stats" line per `interval` for the whole scheduler (all its executors), as
    vLLM's periodic log: throughput over the interval, the queues, KV usage and the prefix-cache
    hit rate. Only while requests run or wait, or when the interval did some work (its last line):
    an idle scheduler says nothing."""

    def __init__(self, interval: float = STATS_LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: _StatsSample | None = None

    def observe(self, stats: SchedulerStats, steps: int, tokens_generated: int, now: float) -> bool:
        """Called often with the engine's figures; logs when an interval has passed and there is
        something to say. Returns whether it logged."""
        if self._last is not None and now - self._last.time < self.interval:
            return False
        sample = _StatsSample(now, steps, tokens_generated, stats.prompt_tokens_computed)
        last, self._last = self._last, sample
        busy = stats.num_running or stats.num_waiting or stats.num_swapped
        if last is None or not (busy or sample.steps != last.steps):
            return False
        seconds = max(now - last.time, 1e-9)
        prompt_tokens = sample.prompt_tokens_computed - last.prompt_tokens_computed
        queried, blocks = stats.prefix_cache_query_tokens, stats.num_gpu_blocks
        log.info(
            "scheduler stats",
            prompt_throughput=round(prompt_tokens / seconds, 1),
            generation_throughput=round((sample.tokens_generated - last.tokens_generated) / seconds, 1),
            running=stats.num_running,
            waiting=stats.num_waiting,
            swapped=stats.num_swapped,
            kv_cache_usage=round(stats.gpu_blocks_in_use / blocks, 4) if blocks else 0.0,
            prefix_cache_hit_rate=round(stats.prefix_cache_hit_tokens / queried, 4) if queried else 0.0,
            preemptions=stats.num_preemptions,
            steps=sample.steps - last.steps,
        )
        return True


class PreemptionWarning:
    """Warns, at most once a `period`, when more than `threshold` preemptions happened within the
    last `window` seconds, naming the flags that make the batch fit."""

    def __init__(
        self,
        threshold: int = PREEMPTION_WARNING_THRESHOLD,
        window: float = PREEMPTION_WINDOW_S,
        period: float = PREEMPTION_WARNING_PERIOD_S,
    ) -> None:
        self.threshold, self.window, self.period = threshold, window, period
        self._samples: deque[tuple[float, int]] = deque()  # (time, preemptions so far)
        self._last_warning: float | None = None

    def observe(self, num_preemptions: int, now: float) -> bool:
        """Takes the preemption counter (never decreasing) at `now`; returns whether it warned."""
        samples = self._samples
        samples.append((now, num_preemptions))
        while len(samples) > 1 and samples[1][0] <= now - self.window:
            samples.popleft()  # keep one sample at or before the window's start: the baseline
        recent = num_preemptions - samples[0][1]
        if recent <= self.threshold:
            return False
        if self._last_warning is not None and now - self._last_warning < self.period:
            return False
        self._last_warning = now
        log.warning(
            "frequent preemption: the running batch does not fit in the KV cache; lower "
            "--max-num-seqs or --max-model-len (or raise the executor's --gpu-memory-utilization)",
            preemptions=recent,
            window_s=round(min(self.window, now - samples[0][0]), 1),
        )
        return True


class SchedulerHealth:
    """grpc.health.v1 for the scheduler, for the services in HEALTH_SERVICES."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._status: int | None = None
        self.draining = False

    async def publish(self, serving: bool) -> None:
        status = SERVING if serving and not self.draining else NOT_SERVING
        if status != self._status:
            self._status = status
            for service in HEALTH_SERVICES:
                await self.servicer.set(service, status)
            log.info("health", status=health_pb2.HealthCheckResponse.ServingStatus.Name(status))

    async def drain(self) -> None:
        """NOT_SERVING for good: the scheduler is shutting down."""
        self.draining = True
        await self.publish(False)
        await self.servicer.enter_graceful_shutdown()


async def watch(
    engine: Engine,
    health_: SchedulerHealth,
    preemption: PreemptionWarning | None = None,
    period: float = WATCH_PERIOD_S,
    stats_log: StatsLog | None = None,
) -> None:
    """Runs until cancelled: health follows `engine.is_serving`; preemptions feed the warning; the
    stats line is logged while there is work."""
    preemption = preemption if preemption is not None else PreemptionWarning()
    stats_log = stats_log if stats_log is not None else StatsLog()
    while True:
        await health_.publish(engine.is_serving)
        now, stats = time.monotonic(), engine.core_stats()
        preemption.observe(stats.num_preemptions, now)
        stats_log.observe(stats, engine.steps, engine.tokens_generated, now)
        await asyncio.sleep(period)
