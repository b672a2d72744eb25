"""Operating pieces that need no service: the preemption warning's rate limit, the stats line that
an idle scheduler keeps to itself, the metrics' exposition (names, types, labels), the engine's
counters across re-attaches, and serve's flags."""

from __future__ import annotations

import argparse

import pytest
import structlog
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.scheduler.completion import FinishReason
from pagedserve.scheduler.core import SchedulerStats
from pagedserve.scheduler.engine import ExecutorStatusView
from pagedserve.scheduler.metrics import SchedulerMetrics, token_buckets
from pagedserve.scheduler.monitor import PreemptionWarning, StatsLog
from pagedserve.scheduler.request import Request, SeqId


@pytest.fixture(autouse=True)
def _default_logging():
    """structlog's defaults (every level), whatever an earlier test of this process configured
    (an in-process `LLM` logs at warning)."""
    structlog.reset_defaults()


def test_preemption_warning_fires_past_the_threshold_at_most_once_a_period():
    warning = PreemptionWarning(threshold=10, window=60.0, period=60.0)
    with structlog.testing.capture_logs() as logs:
        assert not warning.observe(0, now=0.0)
        assert not warning.observe(10, now=30.0)  # 10 in the window: not more than the threshold
        assert warning.observe(11, now=31.0)
        assert not warning.observe(40, now=60.0)  # frequent still, but warned 29 s ago
        assert warning.observe(60, now=91.5)  # a period later: warns again
        assert not warning.observe(60, now=200.0)  # none in the last minute
        assert not warning.observe(65, now=230.0)
    assert len(logs) == 2
    assert logs[0]["log_level"] == "warning"
    assert "--max-num-seqs" in logs[0]["event"]
    assert "--max-model-len" in logs[0]["event"]
    assert logs[0]["preemptions"] == 11


def test_preemption_warning_counts_only_the_last_window():
    warning = PreemptionWarning(threshold=6, window=60.0, period=60.0)
    for t in range(0, 600, 10):  # 1 preemption every 10 s: 6 a minute, a steady trickle
        fired = warning.observe(t // 10, now=float(t))
        assert not fired, t


def _stats(running: int = 0, waiting: int = 0, prompt_tokens: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_waiting=waiting, num_running=running, num_swapped=0, num_preemptions=0, num_gpu_blocks=100,
        gpu_blocks_in_use=10 * running, peak_gpu_blocks_in_use=40, cached_free_blocks=0,
        slot_utilization=0.5, peak_slot_utilization=0.9, prompt_tokens_computed=prompt_tokens,
        prefix_cache_hit_tokens=32, prefix_cache_query_tokens=128,
    )  # fmt: skip


def test_stats_line_only_while_there_is_work_once_an_interval():
    log = StatsLog(interval=10.0)
    with structlog.testing.capture_logs() as logs:
        assert not log.observe(_stats(), steps=0, tokens_generated=0, now=0.0)  # the first sample
        for t in range(1, 60):  # idle for a minute: nothing
            assert not log.observe(_stats(), steps=0, tokens_generated=0, now=float(t))
        assert log.observe(_stats(running=2, prompt_tokens=400), steps=50, tokens_generated=100, now=61.0)
        assert not log.observe(_stats(running=2), steps=60, tokens_generated=120, now=65.0)  # too soon
        # The work ended within the interval: one last line says what it did, then silence.
        assert log.observe(_stats(prompt_tokens=400), steps=80, tokens_generated=160, now=71.0)
        for t in range(72, 200):
            assert not log.observe(_stats(prompt_tokens=400), steps=80, tokens_generated=160, now=float(t))
    assert [entry["event"] for entry in logs] == ["scheduler stats"] * 2
    first = logs[0]
    assert first["running"] == 2 and first["steps"] == 50
    # Over the 11 s since the last (idle) sample, at t=50.
    assert first["generation_throughput"] == round(100 / 11, 1)
    assert first["prompt_throughput"] == round(400 / 11, 1)
    assert first["kv_cache_usage"] == 0.2 and first["prefix_cache_hit_rate"] == 0.25
    assert logs[1]["running"] == 0 and logs[1]["steps"] == 30


def test_token_buckets_follow_vllm_1_2_5():
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(64)[-1] == 50


class FakeEngine:
    """The engine's operator interface, with fixed answers."""

    def core_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=2, num_running=3, num_swapped=1, num_preemptions=7, num_gpu_blocks=100,
            gpu_blocks_in_use=25, peak_gpu_blocks_in_use=30, cached_free_blocks=4, slot_utilization=0.9,
            peak_slot_utilization=0.95, prompt_tokens_computed=500, prefix_cache_hit_tokens=64,
            prefix_cache_query_tokens=256,
        )  # fmt: skip

    def executor_statuses(self) -> list[ExecutorStatusView]:
        return [
            ExecutorStatusView(
                address="10.0.0.1:50061",
                attached=True,
                lease_epoch=5,
                num_running=3,
                num_waiting=2,
                num_gpu_blocks=100,
                gpu_blocks_in_use=25,
                requests_routed=9,
                prefix_cache_hit_tokens=64,
                state="attached",
                steps=42,
                busy_seconds=1.5,
            )  # fmt: skip
        ]


def _families(metrics: SchedulerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def test_metrics_exposition_names_types_and_labels():
    metrics = SchedulerMetrics(FakeEngine(), "tiny", max_model_len=256)  # type: ignore[arg-type]
    request = Request(SeqId(1), [1, 2, 3, 4], max_tokens=8)
    request.first_scheduled_time = request.arrival_time + 0.25
    recorder = metrics.stream(request.arrival_time)
    recorder.sent(1, request)
    recorder.sent(2, request)  # two merged deltas
    recorder.sent(0, request)  # a text-only message
    recorder.ended(request, FinishReason.LENGTH)
    recorder.ended(request, None)  # the stream's cleanup after the end: not counted again
    families, text = _families(metrics)
    assert "_created" not in text
    expect = {
        "pagedserve:num_requests_running": ("gauge", 3),
        "pagedserve:num_requests_waiting": ("gauge", 2),
        "pagedserve:num_requests_swapped": ("gauge", 1),
        "pagedserve:kv_cache_usage_perc": ("gauge", 0.25),
        "pagedserve:num_preemptions": ("counter", 7),
        "pagedserve:prefix_cache_queries": ("counter", 256),
        "pagedserve:prefix_cache_hits": ("counter", 64),
        "pagedserve:prompt_tokens": ("counter", 4),
        "pagedserve:generation_tokens": ("counter", 3),
    }
    for name, (kind, value) in expect.items():
        family = families[name]
        assert family.type == kind, name
        (sample,) = [s for s in family.samples if not s.name.endswith("_created")]
        assert sample.labels == {"model_name": "tiny"}, name
        assert sample.value == value, name
    assert "pagedserve:prompt_tokens_total{" in text
    assert "pagedserve:num_preemptions_total{" in text
    success = {s.labels["finished_reason"]: s.value for s in families["pagedserve:request_success"].samples}
    assert success == {"stop": 0, "length": 1, "abort": 0}
    for name, count in (
        ("time_to_first_token_seconds", 1),
        ("inter_token_latency_seconds", 2),
        ("e2e_request_latency_seconds", 1),
        ("request_queue_time_seconds", 1),
        ("request_prompt_tokens", 1),
        ("request_generation_tokens", 1),
    ):
        family = families["pagedserve:" + name]
        assert family.type == "histogram"
        (sample,) = [s for s in family.samples if s.name.endswith("_count")]
        assert sample.value == count, name
    queue = families["pagedserve:request_queue_time_seconds"].samples
    assert [s.value for s in queue if s.name.endswith("_sum")] == [0.25]
    cumulative = {s.labels["le"]: s.value for s in queue if s.name.endswith("_bucket")}
    assert (cumulative["0.1"], cumulative["0.3"], cumulative["+Inf"]) == (0, 1, 1)  # le is inclusive
    generation = families["pagedserve:request_generation_tokens"].samples
    assert [s.value for s in generation if s.name.endswith("_sum")] == [3]
    steps = families["pagedserve:executor_scheduled_steps"].samples
    assert [(s.labels, s.value) for s in steps] == [
        ({"model_name": "tiny", "executor": "10.0.0.1:50061"}, 42)
    ]
    assert families["pagedserve:executor_step_seconds"].samples[0].value == 1.5
    assert families["pagedserve:executor_gpu_blocks_in_use"].samples[0].value == 25


def test_serve_gives_the_executor_the_next_metrics_port():
    from pagedserve.cli import add_serve_args, executor_metrics_port

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert executor_metrics_port(parser.parse_args([])) is None
    args = parser.parse_args(["--metrics-port", "9100"])
    assert (args.metrics_port, executor_metrics_port(args)) == (9100, 9101)
    args = parser.parse_args(["--metrics-port", "9100", "--executor-metrics-port", "9200"])
    assert executor_metrics_port(args) == 9200


def test_health_watch_through_the_public_interceptor():
    """grpc.health.v1's Watch writes with context.write() (no async generator): the public server's
    request-parsing interceptor passes it through, and Watch sees every transition."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.protos import wire
    from pagedserve.scheduler.monitor import SchedulerHealth
    from pagedserve.scheduler.service import MalformedRequestInterceptor

    async def run() -> list[int]:
        health = SchedulerHealth()
        await health.publish(False)
        server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            call = stub.Watch(health_pb2.HealthCheckRequest(service=wire.SCHEDULER_HEALTH_SERVICE))
            seen.append((await call.read()).status)
            await health.publish(True)
            seen.append((await call.read()).status)
            await health.drain()
            seen.append((await call.read()).status)
            await health.publish(True)  # draining: stays NOT_SERVING
            seen.append((await stub.Check(health_pb2.HealthCheckRequest(service=""))).status)
            call.cancel()
        await server.stop(0)
        return seen

    status = health_pb2.HealthCheckResponse
    assert asyncio.run(run()) == [status.NOT_SERVING, status.SERVING, status.NOT_SERVING, status.NOT_SERVING]
