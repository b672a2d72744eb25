"""The internal token between scheduler and executor: where it comes from, how it travels, how the
executor checks it.

Anyone who reaches an executor's port could otherwise Attach and take it over (an Attach drops
every request of the current lease). So when a token is configured, the scheduler sends
`authorization: Bearer <token>` on every executor call and the executor refuses any RPC without it
with UNAUTHENTICATED before the handler runs. grpc.health.v1 stays open: kubelet and compose probes
carry no token, and health reveals nothing and changes nothing.

Without a token both sides run open (one warning at start), which is what a single-host `pagedserve
serve` on loopback or a test wants; a deployment passes the same secret to both services.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog

from pagedserve.protos import wire

log = structlog.get_logger(__name__)

# Methods the executor serves without the token: the standard health service (probes have no token).
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
_BEARER = "Bearer "


class TokenError(ValueError):
    """The configured token cannot be used (an empty or unreadable --internal-token-file)."""


def read_internal_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The internal token: the file's contents when `token_file` is given (it wins over the
    environment), else PAGEDSERVE_INTERNAL_TOKEN; surrounding whitespace stripped (a secret file
    usually ends in a newline). None when neither is set (or the variable is empty).

    Raises:
        TokenError: the file cannot be read, or holds only whitespace.
    """
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read --internal-token-file {token_file}: {exc.strerror}") from None
        if not token:
            raise TokenError(f"--internal-token-file {token_file} is empty")
        return token
    environ = os.environ if environ is None else environ
    return environ.get(wire.INTERNAL_TOKEN_ENV, "").strip() or None


def warn_if_open(token: str | None, service: str) -> None:
    """Logs, once per process start, that the internal link is unauthenticated."""
    if token is None:
        log.warning(
            "internal link unauthenticated",
            service=service,
            hint=f"set {wire.INTERNAL_TOKEN_ENV} or --internal-token-file on the scheduler and the executor",
        )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every executor call carries: `authorization: Bearer <token>` (nothing when open)."""
    return () if token is None else ((wire.AUTHORIZATION_KEY, _BEARER + token),)


class MetadataStub:
    """A generated stub whose every call also carries `metadata` (the caller's own metadata is
    kept). Applied where the channel's stub is made, so no call site can forget the token; unlike
    a client interceptor it adds nothing to each message of a stream (the metadata goes once)."""

    def __init__(self, stub: Any, metadata: Sequence[tuple[str, str]]) -> None:
        self._stub = stub
        self._metadata = tuple(metadata)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)
        if not self._metadata:
            return method
        extra = self._metadata

        def call(*args: Any, metadata: Sequence[tuple[str, str]] | None = None, **kwargs: Any) -> Any:
            return method(*args, metadata=(*extra, *(metadata or ())), **kwargs)

        return call


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers UNAUTHENTICATED (the real one
    never runs, so an Attach without the token leaves the lease as it was)."""

    def refuse(_request: object, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC (but grpc.health.v1's) whose `authorization` metadata is not
    `Bearer <token>`, with UNAUTHENTICATED and a message saying which it was (missing or wrong).
    Compared in constant time (hmac.compare_digest), so the answer's timing says nothing of the
    token. For a synchronous grpc server (the executor's)."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._expected = (_BEARER + token).encode()
        self._open_prefixes = open_prefixes

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """None when `metadata` carries the token, else why not."""
        values = [v for k, v in metadata or () if k == wire.AUTHORIZATION_KEY]
        if not values:
            return (
                f"missing '{wire.AUTHORIZATION_KEY}: Bearer <token>' metadata: this executor requires "
                f"the internal token ({wire.INTERNAL_TOKEN_ENV} or --internal-token-file on the scheduler)"
            )
        value = values[0]
        got = value if isinstance(value, bytes) else value.encode()
        if not hmac.compare_digest(got, self._expected):
            return "wrong internal token: the scheduler's and this executor's tokens differ"
        return None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(self._open_prefixes):
            return continuation(handler_call_details)
        problem = self.check(handler_call_details.invocation_metadata)
        handler = continuation(handler_call_details)
        if problem is None or handler is None:
            return handler
        log.warning("executor.unauthenticated", method=handler_call_details.method, reason=problem)
        return _refusal(handler, problem)
