"""Per-client throttling of the public API (`--client-rate-limit N`).

Each client may start N requests in any one-second window (asyncio-throttle's sliding window). A
request beyond that waits for its turn, up to its gRPC deadline (DEADLINE_EXCEEDED if that passes
first), while other clients' requests go through at once: each client waits on its own throttler.
A client whose waiting backlog already holds `max_waiting` requests (--max-queue-len) gets
RESOURCE_EXHAUSTED instead of one more waiter.

A client is the value of its `x-client-id` metadata (a gateway in front sets it per tenant), else
its peer address without the port. The id is a claim, not an identity: a client that may set it can
pose as another or spread over many; put authentication in front where that matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from asyncio_throttle import Throttler

from pagedserve.protos import wire

# The public methods that are throttled: those that cost the service work. GetModelInfo (a cheap
# probe) and Admin stay open.
THROTTLED_METHODS = frozenset({"/pagedserve.v1.Generation/Generate", "/pagedserve.v1.Generation/Tokenize"})
# Longer client ids are cut: the id keys a map entry, and metadata alone may be 8 KiB.
MAX_CLIENT_ID_CHARS = 256
RATE_PERIOD_S = 1.0


class BacklogFull(Exception):
    """The client already has `max_waiting` requests waiting for their turn."""


def client_key(metadata: Sequence[tuple[str, str | bytes]] | None, peer: str) -> str:
    """Who a request counts against: `id:<x-client-id>`, else `peer:<address without the port>`
    (grpc's peer is "ipv4:10.0.0.7:53211", "ipv6:[::1]:53211" or "unix:/path")."""
    for key, value in metadata or ():
        if key == wire.CLIENT_ID_KEY and value:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            return "id:" + text[:MAX_CLIENT_ID_CHARS]
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = peer.rsplit(":", 1)[0]
    return "peer:" + peer


@dataclass
class _Client:
    throttler: Throttler
    # Only the head of a client's line polls its throttler; asyncio.Lock wakes waiters in arrival
    # order, so a client's requests start in the order they came.
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0
    last_start: float = 0.0


class ClientThrottle:
    """The one owner of per-client throttling state. Clients idle for longer than the rate's
    window (nothing waiting, nothing started within it) are forgotten: a fresh entry behaves
    exactly as theirs would, so the map holds only clients active in the last second or so."""

    def __init__(
        self, rate_limit: int, max_waiting: int, period: float = RATE_PERIOD_S, clock=time.monotonic
    ) -> None:
        if rate_limit < 1 or max_waiting < 0:
            raise ValueError(f"rate_limit must be >= 1 and max_waiting >= 0, got {rate_limit}, {max_waiting}")
        self.rate_limit = rate_limit
        self.max_waiting = max_waiting
        self.period = period
        self._clock = clock
        self._clients: dict[str, _Client] = {}
        self._last_sweep = clock()

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def waiting(self, client: str) -> int:
        entry = self._clients.get(client)
        return 0 if entry is None else entry.waiting

    async def admit(self, client: str, timeout: float | None = None) -> None:
        """Returns once `client` may start one more request.

        Raises:
            BacklogFull: `max_waiting` requests of this client are already waiting.
            TimeoutError: `timeout` seconds passed before its turn came (nothing is counted).
        """
        self._sweep()
        entry = self._clients.get(client)
        if entry is None:
            entry = self._clients[client] = _Client(Throttler(rate_limit=self.rate_limit, period=self.period))
        if entry.waiting >= self.max_waiting:
            raise BacklogFull(
                f"client {client[:80]!r} already has {entry.waiting} requests waiting for its rate limit "
                f"({self.rate_limit}/s, at most {self.max_waiting} waiting: --max-queue-len)"
            )
        # With nobody waiting and a slot free, neither the lock nor the throttler suspends: the
        # request is counted as waiting only while it really waits.
        entry.waiting += 1
        try:
            async with asyncio.timeout(timeout), entry.turn:
                await entry.throttler.acquire()
            entry.last_start = self._clock()
        finally:
            entry.waiting -= 1

    def _sweep(self) -> None:
        now = self._clock()
        if now - self._last_sweep < self.period:
            return
        self._last_sweep = now
        idle = [k for k, c in self._clients.items() if c.waiting == 0 and now - c.last_start > self.period]
        for key in idle:
            del self._clients[key]


class ThrottleInterceptor(grpc.aio.ServerInterceptor):
    """Applies a `ClientThrottle` to THROTTLED_METHODS before their handler runs."""

    def __init__(self, throttle: ClientThrottle) -> None:
        self.throttle = throttle

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        key = client_key(context.invocation_metadata(), context.peer())
        remaining = context.time_remaining()
        try:
            await self.throttle.admit(key, remaining)
        except BacklogFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the deadline passed while waiting for the client rate limit ({self.throttle.rate_limit}/s)",
            )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in THROTTLED_METHODS:
            return handler
        admit = self._admit
        if handler.unary_stream:
            behavior = handler.unary_stream

            async def unary_stream(request, context: grpc.aio.ServicerContext):
                await admit(context)
                # aclosing: a cancelled stream closes the handler's generator now, running its cleanup.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary:
            behavior_uu = handler.unary_unary

            async def unary_unary(request, context: grpc.aio.ServicerContext):
                await admit(context)
                return await behavior_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
