"""The gateway's side of the public gRPC API: one or more schedulers, round robin.

Each `--scheduler` address gets one grpc.aio channel. A `dns:///name:port` address is one channel
that grpc resolves itself and balances with its own round_robin policy over every address the name
has. Requests go to the channels in turn; a scheduler that answers UNAVAILABLE before the first
token (it is down, or has no executor) is skipped and the next one tried, so one bad scheduler
costs no request while another serves.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import grpc

from pagedserve.protos import generation_pb2, generation_pb2_grpc

# Reconnect to a scheduler that went away within seconds of its return (grpc's default backoff
# grows to two minutes), so /health and the round robin see it back soon.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
]


class NoScheduler(Exception):
    """No scheduler is configured or reachable."""


@dataclass
class _Target:
    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub


class SchedulerPool:
    """Channels to the schedulers; call `start` from the event loop that will use them."""

    def __init__(self, addresses: list[str]) -> None:
        if not addresses:
            raise ValueError("at least one scheduler address is needed")
        self.addresses = list(addresses)
        self._targets: list[_Target] = []
        self._turn = itertools.count()

    async def start(self) -> None:
        for address in self.addresses:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._targets.append(_Target(address, channel, generation_pb2_grpc.GenerationStub(channel)))

    async def close(self) -> None:
        for target in self._targets:
            await target.channel.close()
        self._targets.clear()

    def _in_turn(self) -> list[_Target]:
        """Every target, starting with the next one in round-robin order."""
        start = next(self._turn) % len(self._targets)
        return self._targets[start:] + self._targets[:start]

    async def generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None
    ) -> tuple[grpc.aio.UnaryStreamCall, generation_pb2.GenerateResponse]:
        """Starts the request on the next scheduler that takes it; returns the call and its first
        message (read with `call.read()` from then on). Raises the last AioRpcError when every
        scheduler answered UNAVAILABLE, and any other status at once."""
        last: grpc.aio.AioRpcError | None = None
        for target in self._in_turn():
            call = target.stub.Generate(request, timeout=timeout)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = exc
                continue
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                call.cancel()
                raise NoScheduler(f"scheduler {target.address} ended the stream without a response")
            return call, first
        assert last is not None
        raise last

    async def model_info(self, timeout: float = 5.0) -> generation_pb2.ModelInfo:
        """The model of the first scheduler that answers (UNAVAILABLE ones skipped)."""
        last: grpc.aio.AioRpcError | None = None
        for target in self._in_turn():
            try:
                return await target.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = exc
        assert last is not None
        raise last
