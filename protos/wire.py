"""The parts of the scheduler <-> executor contract that live outside the .proto files: metadata
keys, message size limits and HTTP/2 keepalive. Both sides import them from here, so they cannot
drift apart (they once did: 64 MiB on one side, 256 MiB on the other)."""

from __future__ import annotations

# `Step` streams carry the lease epoch that `Attach` returned; a stale one is refused.
LEASE_EPOCH_KEY = "lease-epoch"

# The largest StepPlan or StepOutput either side sends or accepts. A plan carrying 8,192 new prompt
# tokens for 512 requests with their block tables is a few MiB; the limit leaves room for
# prompt logprobs of long prompts.
MAX_MESSAGE_BYTES = 256 << 20

# HTTP/2 keepalive on the scheduler's channel to an executor: an executor that stops answering (a
# frozen process, a host gone without closing its connections) fails the Step stream with
# UNAVAILABLE ("ping timeout") about 10 s after its last reply, as a crash does at once, instead of
# leaving every client stream hanging. (grpc 1.84 waits `grpc.http2.ping_timeout_ms` for the ack,
# not `grpc.keepalive_timeout_ms`.) A busy executor still acks: grpc's own threads answer pings.
KEEPALIVE_TIME_MS = 10_000
PING_TIMEOUT_MS = 10_000
# The executor's server accepts pings this often; by default a server answers pings as frequent as
# the scheduler's on an idle stream with GOAWAY.
MIN_PING_INTERVAL_MS = 5_000

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
]
"""Options of the scheduler's channel to an executor."""

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    # A port in use is an error, not a port shared with another server (SO_REUSEPORT would split
    # the schedulers' connections between the two).
    ("grpc.so_reuseport", 0),
]
"""Options of the executor's server."""


def lease_metadata(lease_epoch: int) -> tuple[tuple[str, str], ...]:
    """The metadata a `Step` stream of lease `lease_epoch` carries."""
    return ((LEASE_EPOCH_KEY, str(lease_epoch)),)

# Every executor RPC carries `authorization: Bearer <token>` when PAGEDSERVE_INTERNAL_TOKEN (or
# --internal-token-file) is set; the executor refuses a missing or wrong one with UNAUTHENTICATED.
AUTHORIZATION_KEY = "authorization"
INTERNAL_TOKEN_ENV = "PAGEDSERVE_INTERNAL_TOKEN"

# The names grpc.health.v1 reports besides "" (the whole server).
SCHEDULER_HEALTH_SERVICE = "pagedserve.v1.Generation"
EXECUTOR_HEALTH_SERVICE = "pagedserve.v1.Executor"
