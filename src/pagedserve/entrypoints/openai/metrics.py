"""The gateway's own Prometheus metrics (GET /metrics): requests by endpoint and status, latency,
time to first token and tokens, as this process saw them. The schedulers' own counters are in
their Admin.GetStats."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.protos import generation_pb2

# No `*_created` series beside each counter and histogram, as in the scheduler's registry
# (scheduler/metrics.py): noise on every dashboard.
prometheus_client.disable_created_metrics()

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """One registry per gateway (not prometheus_client's global one: tests run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagedserve_gateway_requests",
            "HTTP requests by endpoint and status (499: the client went away)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "pagedserve_gateway_request_duration_seconds",
            "from the request to the last byte of the response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pagedserve_gateway_time_to_first_token_seconds",
            "from the request to the scheduler's first message",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "pagedserve_gateway_tokens", "tokens of finished requests", ["kind"], registry=self.registry
        )
        self.in_flight = Gauge(
            "pagedserve_gateway_requests_in_flight",
            "requests streaming from a scheduler",
            registry=self.registry,
        )

        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels: str):
        """`metric.labels(*labels)`, remembered: prometheus_client's lookup costs per call."""
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def first_token(self, endpoint: str, seconds: float) -> None:
        self._child(self.ttft, endpoint).observe(seconds)
        self.in_flight.inc()

    def finished(
        self,
        endpoint: str,
        status: int,
        seconds: float,
        usage: generation_pb2.Usage | None,
        started: bool = True,
    ) -> None:
        self._child(self.requests, endpoint, str(status)).inc()
        self._child(self.latency, endpoint).observe(seconds)
        if started:
            self.in_flight.dec()
        if usage is not None:
            self._child(self.tokens, "prompt").inc(usage.prompt_tokens)
            self._child(self.tokens, "completion").inc(usage.completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
