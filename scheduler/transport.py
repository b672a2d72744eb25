"""How the engine reaches its executor: the Step protocol's two calls behind a small interface.

`GrpcTransport` is the service path (one channel to the executor service); `pagedserve bench
--in-process` plugs a runner in the same process into the same interface to measure what the
service split costs. Either way the engine sees only the protocol's messages.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire


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


# A lost executor is reconnected at most this long after it is back: gRPC's default backoff grows
# to 120 s between attempts, and a restarted executor sat idle for most of a minute (measured in
# tests/test_scale_out_e2e.py) while its requests ran elsewhere.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]


class GrpcTransport:
    """The executor service at `address`, over one channel opened on first attach (inside the
    event loop that will use it)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None

    def __str__(self) -> str:
        return self.address

    def _stub(self) -> executor_pb2_grpc.ExecutorStub:
        if self._channel is None:
            options = [*wire.CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
            self._channel = grpc.aio.insecure_channel(self.address, options=options)
        return executor_pb2_grpc.ExecutorStub(self._channel)

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
