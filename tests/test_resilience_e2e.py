"""Losing the executor mid-stream or while idle: the scheduler stays up, re-attaches to the restarted
executor under a new lease, and the interrupted streams complete without a lost or duplicated token.
Hostile loads (a full queue, a prompt of megabytes) get a clear status without stalling the other
clients."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from pagedserve.client import generate, make_request, stream
from tests.services import hf_greedy, running_services, scheduler_stats, wait_for_idle

pytestmark = pytest.mark.slow


LONG = 200  # greedy tokens of an interrupted stream (no EOS within them for this prompt)
PROMPT = [20, 30, 40, 50] * 3


def test_executor_crash_mid_stream_loses_no_token(tiny_model_dir, hf_model, tmp_path):
    """The only executor dies mid-stream (SIGKILL) and comes back on its port: the stream waits,
    is recomputed from its prompt and the tokens already streamed, and completes with exactly the
    greedy tokens of an undisturbed run."""
    with running_services(tiny_model_dir, tmp_path) as services, services.channel() as channel:
        responses = stream(channel, make_request(PROMPT, max_tokens=LONG, temperature=0), timeout=120)
        tokens = list(next(responses).token_ids)  # streaming has begun
        services.restart_executor()
        for response in responses:
            tokens += response.token_ids
        assert tokens == hf_greedy(hf_model, PROMPT, LONG)
        assert services.scheduler.poll() is None
        assert "requests re-placed" in services.scheduler_log()


def test_frozen_executor_is_lost_and_its_stream_resumes(tiny_model_dir, hf_model, tmp_path):
    """An executor that stops answering without closing its connection (SIGSTOP here; a host that
    vanished looks the same): keepalive notices within ~20 s and the scheduler drops it (its blocks
    leave the stats); the stream waits, and once the executor runs again the scheduler re-attaches
    and the stream completes with the tokens of an undisturbed run."""
    with running_services(tiny_model_dir, tmp_path) as services, services.channel() as channel:
        responses = stream(channel, make_request(PROMPT, max_tokens=LONG, temperature=0), timeout=180)
        tokens = list(next(responses).token_ids)  # streaming has begun
        services.executor.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while scheduler_stats(services).num_gpu_blocks:  # attached to the frozen executor
                assert time.monotonic() < deadline, "the frozen executor was never dropped"
                time.sleep(0.2)
        finally:
            services.executor.send_signal(signal.SIGCONT)
        for response in responses:
            tokens += response.token_ids
        assert tokens == hf_greedy(hf_model, PROMPT, LONG)
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
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline
                    time.sleep(0.2)


def test_executor_lost_while_idle_is_noticed_and_replaced(tiny_model_dir, tmp_path):
    """The executor dies while no step is in flight, so nothing reads the step stream when it ends:
    the idle scheduler notices anyway, re-attaches once the executor is back, and the next request is
    served at once (no client sees the loss)."""
    with running_services(tiny_model_dir, tmp_path) as services:
        with services.channel() as channel:
            assert generate(channel, make_request([5, 6, 7], max_tokens=2), timeout=30).token_ids
            wait_for_idle(services)
            time.sleep(0.5)  # the plan sent one step ahead completes: nothing is in flight now
            services.restart_executor()
            deadline = time.monotonic() + 60
            while scheduler_stats(services).num_gpu_blocks:  # attached to the old executor
                assert time.monotonic() < deadline, "the scheduler never noticed the executor's loss"
                time.sleep(0.1)
            while not scheduler_stats(services).num_gpu_blocks:  # until it re-attached
                assert services.scheduler.poll() is None, f"scheduler exited:\n{services.scheduler_log()}"
                assert time.monotonic() < deadline, "the scheduler never re-attached"
                time.sleep(0.1)
            result = generate(channel, make_request([5, 6, 7], max_tokens=4), timeout=30)
            assert len(result.token_ids) == 4
        assert services.scheduler.poll() is None


def test_huge_text_prompt_does_not_stall_other_streams(tiny_model_dir, tmp_path):
    """A text of megabytes takes seconds to tokenize: it is refused with INVALID_ARGUMENT, and a
    stream already running keeps receiving tokens meanwhile."""
    arrivals: list[float] = []
    with running_services(tiny_model_dir, tmp_path) as services, services.channel() as channel:
        responses = stream(channel, make_request([7] * 8, max_tokens=1000, ignore_eos=True, temperature=0))
        next(responses)

        def read() -> None:
            try:
                for _ in responses:
                    arrivals.append(time.monotonic())
            except grpc.RpcError:
                pass  # cancelled below

        reader = threading.Thread(target=read)
        reader.start()
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(channel, make_request("hello world, " * 250_000, max_tokens=2), timeout=60)
        end = time.monotonic()
        responses.cancel()
        reader.join(timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in err.value.details()
    # Gaps between the other stream's messages while the huge prompt was handled (up to the
    # stream's own end, if it finished first): none may last most of that time.
    window_end = min(end, arrivals[-1])
    times = [start, *(t for t in arrivals if start < t < window_end), window_end]
    longest_gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    assert longest_gap < 0.5 * (end - start), (longest_gap, end - start)
