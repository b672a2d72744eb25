"""Losing the executor mid-stream: clients get UNAVAILABLE (none hangs), the scheduler stays up,
re-attaches to the restarted executor under a new lease, and serves again."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pagedserve.client import generate, make_request, stream
from tests.services import running_services, wait_until_ready

pytestmark = pytest.mark.slow


def test_executor_crash_fails_streams_then_recovers(tiny_model_dir, tmp_path):
    with running_services(tiny_model_dir, tmp_path) as services:
        with services.channel() as channel:
            responses = stream(channel, make_request([9] * 30, max_tokens=990, ignore_eos=True), timeout=60)
            next(responses)  # streaming has begun
            errors: list[grpc.RpcError] = []

            def drain() -> None:
                try:
                    for _ in responses:
                        pass
                except grpc.RpcError as exc:
                    errors.append(exc)

            reader = threading.Thread(target=drain)
            reader.start()
            services.restart_executor()
            reader.join(timeout=60)
            assert not reader.is_alive(), "the stream hung after the executor died"
            assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
            assert "executor" in errors[0].details()

            deadline = time.monotonic() + 60
            while True:  # until the scheduler has re-attached to the new executor
                try:
                    result = generate(
                        channel, make_request([5, 6, 7], max_tokens=4, temperature=0), timeout=30
                    )
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "the scheduler never re-attached"
                    time.sleep(0.5)
            assert len(result.token_ids) >= 1
        wait_until_ready(services)
        assert services.scheduler.poll() is None


def test_scheduler_plans_within_the_executor_limits(tiny_model_dir, hf_model, tmp_path):
    """A scheduler configured for bigger steps than its executor accepts plans within the executor's
    limits (reported on attach) instead of having every plan refused."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.services import hf_greedy

    prompts = [[20 + i, 30 + i, 40 + i] * (i + 1) for i in range(8)]
    executor_args = ("--max-num-seqs=4", "--max-num-batched-tokens=32")
    scheduler_args = ("--max-num-seqs=64", "--max-num-batched-tokens=4096")
    with running_services(tiny_model_dir, tmp_path, executor_args, scheduler_args) as services:
        with services.channel() as channel, ThreadPoolExecutor(len(prompts)) as pool:
            requests = [make_request(p, max_tokens=6, temperature=0) for p in prompts]
            results = list(pool.map(lambda r: generate(channel, r, timeout=120), requests))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, 6)


def test_full_queue_gets_resource_exhausted(tiny_model_dir, tmp_path):
    """Past --max-queue-len held requests, a new one is refused at once, and served once room frees."""
    with running_services(tiny_model_dir, tmp_path, scheduler_args=("--max-queue-len=1",)) as services:
        with services.channel() as channel:
            first = stream(channel, make_request([9] * 10, max_tokens=900, ignore_eos=True), timeout=60)
            next(first)  # the first request is held
            with pytest.raises(grpc.RpcError) as err:
                generate(channel, make_request([5, 6], max_tokens=2), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max-queue-len" in err.value.details()
            first.cancel()
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert generate(channel, make_request([5, 6], max_tokens=2), timeout=30).token_ids
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.2)
