"""Operating the services as a platform does, on real processes: standard gRPC health (Check and
Watch) and reflection seen by grpc's own clients, Prometheus metrics scraped over HTTP and checked
for exact counts, deadlines that free blocks, and SIGTERM drains of both services."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.client import generate, make_request, stream
from pagedserve.protos import wire
from tests.services import REPO, free_port, running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def wait_for_status(port: int, status: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while check(port, wire.SCHEDULER_HEALTH_SERVICE) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.1)


def health_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "health", *args],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip


def scrape(port: int) -> dict[str, float]:
    """Every sample of the /metrics page by name and labels, e.g. 'x_total{a="b"}' -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_health_watch_reflection_and_executor_sigterm(tiny_model_dir, tmp_path):
    """Health follows the executor (Check and Watch): SERVING, NOT_SERVING once it is killed,
    SERVING again once it is back; reflection lists the public services; the executor on SIGTERM
    in the middle of a stream exits 0, the scheduler goes NOT_SERVING, and the stream continues on
    the executor started after it, to its last token."""
    with running_services(tiny_model_dir, tmp_path) as services:
        wait_for_status(services.port, SERVING)
        assert check(services.port) == SERVING
        assert check(services.executor_port) == SERVING
        assert check(services.executor_port, wire.EXECUTOR_HEALTH_SERVICE) == SERVING
        ok = health_cli(f"--port={services.port}")
        assert ok.returncode == 0, ok
        assert "SERVING" in ok.stdout, ok
        assert health_cli("--executor", f"--port={services.executor_port}").returncode == 0

        with services.channel() as channel:
            services_listed = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert {"pagedserve.v1.Generation", "pagedserve.v1.Admin", "grpc.health.v1.Health"} <= set(
            services_listed
        )

        seen: list[int] = []
        channel = services.channel()
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=wire.SCHEDULER_HEALTH_SERVICE)
        )

        def read_watch() -> None:
            try:
                for reply in watch:
                    seen.append(reply.status)
            except grpc.RpcError:
                pass  # cancelled at the end

        reader = threading.Thread(target=read_watch)
        reader.start()
        try:
            services.executor.kill()
            services.executor.wait(timeout=10)
            wait_for_status(services.port, NOT_SERVING)
            bad = health_cli(f"--port={services.port}")
            assert bad.returncode == 1, bad
            assert "NOT_SERVING" in bad.stderr, bad
            services.start_executor()
            wait_for_status(services.port, SERVING, timeout=120)
            deadline = time.monotonic() + 10
            while seen[-1:] != [SERVING] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert seen == [SERVING, NOT_SERVING, SERVING]

            # SIGTERM mid-stream: the executor finishes its step, ends its Step stream, exits 0;
            # the scheduler goes NOT_SERVING and the client's stream waits for an executor, on
            # which it continues (scale-out failover) to its last token.
            responses = stream(channel, make_request([9] * 10, max_tokens=900, ignore_eos=True))
            received = len(next(responses).token_ids)
            services.executor.send_signal(signal.SIGTERM)
            assert services.executor.wait(timeout=30) == 0
            log = services.executor_log()
            assert "executor.stopped" in log
            assert "step_failed" not in log
            wait_for_status(services.port, NOT_SERVING)
            services.start_executor()
            received += sum(len(r.token_ids) for r in responses)
            assert received == 900
        finally:
            watch.cancel()
            reader.join(timeout=10)
            channel.close()


def test_metrics_count_exactly_and_deadline_frees_blocks(tiny_model_dir, tmp_path):
    """N requests: the scraped counters equal the usage and tokens streamed; a request whose
    deadline passes mid-generation is aborted with its blocks freed at once, and counted."""
    metrics_port, executor_metrics_port = free_port(), free_port()
    with running_services(
        tiny_model_dir,
        tmp_path,
        executor_args=(f"--metrics-port={executor_metrics_port}",),
        scheduler_args=(f"--metrics-port={metrics_port}",),
    ) as services:
        with services.channel() as channel:
            probe = generate(channel, make_request([11, 12, 13], max_tokens=6, temperature=0), timeout=60)
            stop_id = probe.token_ids[2]  # greedy: the same request stops at its third token
            requests = [make_request([11, 12, 13], max_tokens=6, temperature=0, stop_token_ids=[stop_id])]
            requests += [
                make_request([20 + i] * (3 + 5 * i), max_tokens=4 + i, ignore_eos=True, temperature=0)
                for i in range(5)
            ]
            requests.append(make_request("The scheduler decides", max_tokens=7, ignore_eos=True))
            with ThreadPoolExecutor(len(requests)) as pool:
                results = [probe, *pool.map(lambda r: generate(channel, r, timeout=120), requests)]
            wait_for_idle(services)
            m = scrape(metrics_port)
            reasons = [r.finish_reason.removeprefix("FINISH_REASON_") for r in results]
            assert reasons.count("STOP") >= 1
            assert m['pagedserve:request_success_total{finished_reason="stop"}'] == reasons.count("STOP")
            assert m['pagedserve:request_success_total{finished_reason="length"}'] == reasons.count("LENGTH")
            assert m['pagedserve:request_success_total{finished_reason="abort"}'] == 0
            prompt_tokens = sum(r.usage.prompt_tokens for r in results)
            generated = sum(len(r.token_ids) for r in results)
            assert generated == sum(r.usage.completion_tokens for r in results)
            assert m["pagedserve:prompt_tokens_total"] == prompt_tokens
            assert m["pagedserve:generation_tokens_total"] == generated
            assert m["pagedserve:request_prompt_tokens_sum"] == prompt_tokens
            assert m["pagedserve:request_generation_tokens_sum"] == generated
            for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                              "request_queue_time_seconds", "request_prompt_tokens"):  # fmt: skip
                assert m[f"pagedserve:{histogram}_count"] == len(results), histogram
            assert m["pagedserve:inter_token_latency_seconds_count"] == generated - len(results)
            stats = scheduler_stats(services)
            assert m["pagedserve:num_requests_running"] == 0
            assert m["pagedserve:kv_cache_usage_perc"] == 0
            assert m["pagedserve:num_preemptions_total"] == stats.num_preemptions
            assert m["pagedserve:prefix_cache_queries_total"] == stats.prefix_cache_query_tokens
            assert m["pagedserve:prefix_cache_hits_total"] == stats.prefix_cache_hit_tokens
            address = f'executor="127.0.0.1:{services.executor_port}"'
            assert m[f"pagedserve:executor_scheduled_steps_total{{{address}}}"] == stats.steps
            assert m[f"pagedserve:executor_num_gpu_blocks{{{address}}}"] == stats.num_gpu_blocks
            e = scrape(executor_metrics_port)
            assert e["pagedserve:executor_steps_total"] == stats.steps
            assert e["pagedserve:executor_kv_blocks_total"] == stats.num_gpu_blocks
            assert e["pagedserve:executor_tokens_sampled_total"] >= generated
            assert e["pagedserve:executor_busy_seconds_total"] > 0

            # A deadline that passes mid-generation: DEADLINE_EXCEEDED, and the blocks free at once.
            received = 0
            with pytest.raises(grpc.RpcError) as err:
                for response in stream(channel, make_request([9] * 40, max_tokens=900, ignore_eos=True), 2.0):
                    received += len(response.token_ids)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert received > 0
            stats = wait_for_idle(services, timeout=2.0)
            assert (stats.gpu_blocks_in_use, stats.num_active_requests) == (0, 0)
            m = scrape(metrics_port)
            assert m['pagedserve:request_success_total{finished_reason="abort"}'] == 1
            assert m["pagedserve:generation_tokens_total"] >= generated + received


def test_sigterm_drains_running_streams(tiny_model_dir, tmp_path):
    """SIGTERM: NOT_SERVING and new streams refused at once, the 8 running streams run to their
    end, exit 0."""
    with running_services(tiny_model_dir, tmp_path, scheduler_args=("--shutdown-grace=120",)) as services:
        wait_for_status(services.port, SERVING)
        channel = services.channel()
        streams = [
            stream(channel, make_request([30 + i] * 5, max_tokens=120, ignore_eos=True, temperature=0))
            for i in range(8)
        ]
        for responses in streams:
            next(responses)  # every stream is running
        with ThreadPoolExecutor(8) as pool:
            finals = [pool.submit(lambda r=r: list(r)[-1]) for r in streams]
            services.scheduler.send_signal(signal.SIGTERM)
            assert check(services.port, wire.SCHEDULER_HEALTH_SERVICE) == NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                generate(channel, make_request([5, 6], max_tokens=2), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in err.value.details()
            assert not any(f.done() for f in finals), "the streams ended before the test could look"
            for final in finals:
                response = final.result(timeout=120)
                assert response.finish_reason == 1
                assert response.usage.completion_tokens == 120  # LENGTH
        assert services.scheduler.wait(timeout=60) == 0
        channel.close()
        assert "drained: every stream finished" in services.scheduler_log()


def test_sigterm_grace_over_ends_streams_with_unavailable(tiny_model_dir, tmp_path):
    """A stream that cannot finish within --shutdown-grace ends with UNAVAILABLE; exit 0."""
    with running_services(tiny_model_dir, tmp_path, scheduler_args=("--shutdown-grace=1",)) as services:
        with services.channel() as channel:
            responses = stream(channel, make_request([9] * 10, max_tokens=900, ignore_eos=True))
            next(responses)
            services.scheduler.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as err:
                for _ in responses:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert services.scheduler.wait(timeout=60) == 0
