"""Prometheus metrics of the executor (its own registry, on its own `--metrics-port`), read from
the runner's counters at scrape time: `pagedserve:executor_*` with a `model_name` label.

The runner's counters are plain ints and floats that only its step loop writes; a scrape reads
each with one attribute load (atomic under the GIL), so it needs no lock and never waits on a step.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.executor.runner import ModelRunner

PREFIX = "pagedserve:executor_"


class RunnerCollector(Collector):
    def __init__(self, runner: ModelRunner, model_name: str) -> None:
        self._runner = runner
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        s = self._runner.stats
        kv = self._runner.kv_cache
        model = [self._model_name]
        counters = (
            ("steps", "Steps run.", s.steps),
            ("tokens_computed", "Tokens whose KV was computed (prefill and decode).", s.tokens_computed),
            ("tokens_sampled", "Tokens sampled.", s.tokens_sampled),
            ("busy_seconds", "Wall time with at least one step in flight.", s.busy_seconds),
            ("swap_out_blocks", "KV blocks copied to the CPU swap pool.", s.swap_out_blocks),
            ("swap_in_blocks", "KV blocks copied back from the CPU swap pool.", s.swap_in_blocks),
            ("graph_steps", "Steps that replayed a CUDA graph.", s.graph_steps),
            (
                "steps_launched_ahead",
                "Speculative verification steps launched before their plan arrived, and taken by it.",
                s.steps_launched_ahead,
            ),
            (
                "steps_discarded_ahead",
                "Steps launched ahead whose plan was another step (rolled back).",
                s.steps_discarded_ahead,
            ),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            yield family
        gauges = (
            ("kv_blocks_total", "Blocks of the device KV pool.", kv.num_device_blocks),
            ("cpu_blocks_total", "Blocks of the CPU swap pool.", kv.num_cpu_blocks),
            ("num_requests", "Requests whose state the executor holds.", self._runner.num_requests),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(model, value)
            yield family


def executor_registry(runner: ModelRunner, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RunnerCollector(runner, model_name))
    return registry
