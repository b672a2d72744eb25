"""500 concurrent Generate streams against real processes: every one completes with the tokens it
asked for (the usage it reports matches what it streamed), nothing is lost or mixed up, and the KV
cache is empty afterwards."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pagedserve.client import make_request
from pagedserve.protos import generation_pb2, generation_pb2_grpc
from tests.services import running_services, wait_for_idle

pytestmark = pytest.mark.slow

NUM_STREAMS = 500


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_500_concurrent_streams_complete_and_free_every_block(services):
    rng = random.Random(0)
    wanted = {
        f"req-{i}": ([rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 9))
        for i in range(NUM_STREAMS)
    }
    all_open = asyncio.Event()
    opened = 0

    async def one(stub, request_id: str, prompt: list[int], max_tokens: int):
        nonlocal opened
        call = stub.Generate(
            make_request(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=request_id), timeout=300
        )
        responses = [await call.read()]
        opened += 1
        if opened == NUM_STREAMS:
            all_open.set()
        await all_open.wait()  # every stream is open (and has its first token) at once
        while responses[-1].finish_reason == 0:
            response = await call.read()
            assert response is not grpc.aio.EOF, f"{request_id} ended without a finish reason"
            responses.append(response)
        assert await call.read() is grpc.aio.EOF
        return responses

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(one(stub, rid, p, n) for rid, (p, n) in wanted.items()))

    results = asyncio.run(run())
    assert len(results) == NUM_STREAMS
    for (request_id, (prompt, max_tokens)), responses in zip(wanted.items(), results, strict=True):
        assert {r.request_id for r in responses} == {request_id}
        tokens = [t for r in responses for t in r.token_ids]
        last = responses[-1]
        assert len(tokens) == max_tokens, request_id
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == len(tokens)
        assert last.usage.prompt_tokens == len(prompt)
    stats = wait_for_idle(services)
    assert stats.gpu_blocks_in_use == 0
    assert stats.num_active_requests == 0
    assert stats.tokens_generated >= sum(n for _, n in wanted.values())
