"""--client-rate-limit on real processes: one client's burst waits its turn while another client's
request goes through; a backlog beyond --max-queue-len gets RESOURCE_EXHAUSTED and a wait that
outlasts the deadline DEADLINE_EXCEEDED, with nothing left behind. Assertions are on order and
status codes, never on wall-clock thresholds."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pagedserve.client import make_request
from pagedserve.protos import generation_pb2_grpc, wire
from tests.services import running_services, wait_for_idle

pytestmark = pytest.mark.slow

RATE = 2
MAX_QUEUE_LEN = 32


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    with running_services(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        scheduler_args=(f"--client-rate-limit={RATE}", f"--max-queue-len={MAX_QUEUE_LEN}"),
    ) as s:
        yield s


async def _request(stub, client: str, timeout: float | None = None) -> tuple[float, float, int]:
    """Runs one request of `client`; returns (time of its first message, time it ended, tokens)."""
    call = stub.Generate(
        make_request([5, 6, 7], max_tokens=3, ignore_eos=True),
        metadata=((wire.CLIENT_ID_KEY, client),),
        timeout=timeout,
    )
    first, tokens = None, 0
    async for response in call:
        first = first or time.monotonic()
        tokens += len(response.token_ids)
    return first, time.monotonic(), tokens


def test_one_clients_burst_does_not_slow_another(services):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            burst = [asyncio.create_task(_request(stub, "A")) for _ in range(20)]
            await asyncio.sleep(0.3)  # A's burst is in, and waiting for its turn
            b = await _request(stub, "B")
            return await asyncio.gather(*burst), b

    a, (b_first, b_end, b_tokens) = asyncio.run(run())
    assert b_tokens == 3
    assert all(tokens == 3 for _, _, tokens in a)
    a_starts = sorted(first for first, _, _ in a)
    # B finished before A's last request even started: B did not queue behind A's burst.
    assert b_end < a_starts[-1]
    started_before_b = sum(start < b_end for start in a_starts)
    assert started_before_b < len(a_starts) // 2, a_starts
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0


def test_a_backlog_is_refused_and_a_deadline_ends_the_wait(services):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            calls = [_request(stub, "C", timeout=2.0) for _ in range(MAX_QUEUE_LEN + 8)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(errors) + sum(isinstance(r, tuple) for r in results) == len(results), results
    codes = [e.code() for e in errors]
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
    refused = [e for e in errors if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    # At most RATE start per second and MAX_QUEUE_LEN wait: the rest are refused at once.
    assert refused
    assert all("--max-queue-len" in e.details() for e in refused)
    assert grpc.StatusCode.DEADLINE_EXCEEDED in codes  # waiters the 2 s deadline overtook
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0
    # And the client is served again once its window is free.
    time.sleep(1.1)

    async def again():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.port}") as channel:
            return await _request(generation_pb2_grpc.GenerationStub(channel), "C", timeout=30)

    assert asyncio.run(again())[2] == 3


def test_tokenize_is_throttled_too_and_model_info_is_not(services):
    from pagedserve.protos import generation_pb2

    metadata = ((wire.CLIENT_ID_KEY, "E"),)
    with services.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # RATE + 1 at once: one of them finds the window full and its 0.6 s deadline passes first.
        tokenize = [
            stub.Tokenize.future(generation_pb2.TokenizeRequest(text="abc"), metadata=metadata, timeout=0.6)
            for _ in range(RATE + 1)
        ]
        probes = [
            stub.GetModelInfo.future(generation_pb2.GetModelInfoRequest(), metadata=metadata, timeout=30)
            for _ in range(5)
        ]
        codes = sorted(f.code().name for f in tokenize)
        assert all(f.result().vocab_size > 0 for f in probes)  # a probe is never throttled
    assert codes == ["DEADLINE_EXCEEDED"] + ["OK"] * RATE
