"""How the engine reaches its executor: the Step protocol's two calls behind a small interface.

`GrpcTransport` is the service path (one channel to the executor service); `pagedserve bench
--in-process` plugs a runner in the same process into the same interface to measure what the
service split costs. Either way the engine sees only the protocol's messages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pagedserve.common.auth import MetadataStub, bearer_metadata, read_internal_token
from pagedserve.common.tls import ChannelTls
from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire
from pagedserve.scheduler.service_config import ServiceConfig


class StepStream(Protocol):
    """One Step stream: plans go out in order and their outputs come back in the same order."""

    async def write(self, plan: executor_pb2.StepPlan) -> None: ...

    async def read(self) -> executor_pb2.StepOutput | None:
        """The next step's output; None once the executor closed the stream."""
        ...

    def cancel(self) -> None: ...

    def ended(self) -> bool:
        """Whether the stream is over on its own (the executor closed it, died or stopped answering),
        which the engine checks while it has nothing in flight and so is not reading."""
        ...


class ExecutorTransport(Protocol):
    """How the engine reaches one executor. Failures raise grpc.aio.AioRpcError or RuntimeError,
    which the engine treats as losing the executor (its requests move to other executors, and it
    re-attaches)."""

    async def attach(self, scheduler_id: str, timeout: float | None) -> executor_pb2.AttachResponse:
        """Takes the executor's lease, waiting up to `timeout` seconds for it to come up; refused
        with FAILED_PRECONDITION while another scheduler's lease is live."""
        ...

    def open_steps(self, lease_epoch: int) -> StepStream: ...

    async def heartbeat(self, lease_epoch: int, timeout: float) -> None:
        """Keeps an idle lease live (FAILED_PRECONDITION: the lease is gone)."""
        ...

    async def detach(self, lease_epoch: int, timeout: float) -> None:
        """Gives the lease up, so that another scheduler may attach at once."""
        ...

    async def close(self) -> None:
        """Releases the connection (the executor was dropped)."""
        ...


class _GrpcStepStream:
    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call

    async def write(self, plan: executor_pb2.StepPlan) -> None:
        try:
            await self._call.write(plan)
        except asyncio.InvalidStateError:
            # The call ended while no read was pending (the executor died while the engine was
            # idle): grpc reports that as a state error, not the RPC's status, so say what ended it.
            code, details = await self._call.code(), await self._call.details()
            raise RuntimeError(f"the executor step stream ended: {code.name}: {details}") from None

    async def read(self) -> executor_pb2.StepOutput | None:
        output = await self._call.read()
        return None if output is grpc.aio.EOF else output

    def cancel(self) -> None:
        self._call.cancel()

    def ended(self) -> bool:
        return self._call.done()


@dataclass(frozen=True)
class ChannelSecurity:
    """How the scheduler's channels to executors prove who sends (the internal token, on every
    call) and check who answers (TLS against the executor's certificate, optionally with a client
    certificate). The default is open plaintext."""

    token: str | None = field(default=None, repr=False)  # never in a log line
    tls: ChannelTls | None = None

    @staticmethod
    def from_config(config: ServiceConfig) -> ChannelSecurity:
        """The token of --internal-token-file (else PAGEDSERVE_INTERNAL_TOKEN) and the
        --executor-ssl-* files. Raises TokenError for an unreadable or empty token file."""
        return ChannelSecurity(read_internal_token(config.internal_token_file), config.executor_channel_tls())


# A lost executor is reconnected at most this long after it is back: gRPC's default backoff grows
# to 120 s between attempts, and a restarted executor sat idle for most of a minute (measured in
# tests/test_scale_out_e2e.py) while its requests ran elsewhere.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]


class GrpcTransport:
    """The executor service at `address`, over one channel opened on first attach (inside the
    event loop that will use it)."""

    def __init__(self, address: str, security: ChannelSecurity = ChannelSecurity()) -> None:
        self.address = address
        self._metadata = bearer_metadata(security.token)
        # The files are read now: a missing one is an error at start, not at the first attach.
        self._credentials = None if security.tls is None else security.tls.credentials()
        self._channel: grpc.aio.Channel | None = None

    def __str__(self) -> str:
        return self.address

    def _stub(self) -> executor_pb2_grpc.ExecutorStub:
        """The stub every executor call goes through: the one place the channel is made, so TLS
        and the `authorization` metadata apply to each RPC (Attach, Step, Heartbeat, ...)."""
        if self._channel is None:
            options = [*wire.CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
            if self._credentials is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=options)
            else:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=options)
        return MetadataStub(executor_pb2_grpc.ExecutorStub(self._channel), self._metadata)

    async def attach(self, scheduler_id: str, timeout: float | None) -> executor_pb2.AttachResponse:
        return await self._stub().Attach(
            executor_pb2.AttachRequest(scheduler_id=scheduler_id), wait_for_ready=True, timeout=timeout
        )

    def open_steps(self, lease_epoch: int) -> StepStream:
        return _GrpcStepStream(self._stub().Step(metadata=wire.lease_metadata(lease_epoch)))

    async def heartbeat(self, lease_epoch: int, timeout: float) -> None:
        await self._stub().Heartbeat(executor_pb2.HeartbeatRequest(lease_epoch=lease_epoch), timeout=timeout)

    async def detach(self, lease_epoch: int, timeout: float) -> None:
        await self._stub().Detach(executor_pb2.DetachRequest(lease_epoch=lease_epoch), timeout=timeout)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
