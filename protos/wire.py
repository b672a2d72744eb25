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

# Public API: the client a request counts against for --client-rate-limit (else its peer address).
CLIENT_ID_KEY = "x-client-id"

# The names grpc.health.v1 reports besides "" (the whole server).
SCHEDULER_HEALTH_SERVICE = "pagedserve.v1.Generation"
EXECUTOR_HEALTH_SERVICE = "pagedserve.v1.Executor"


# ---- the public API's value ranges and size limits ----------------------------------------------
# What GenerateRequest's scalar types can carry (generation.proto): a value outside them has no
# wire form, so every door refuses it (pagedserve.common.validation) instead of wrapping it or
# failing while it fills the message.
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite 32-bit float (`float` fields)

# Limits of a GenerateRequest beyond the model's own (vocabulary, max_model_len). Each stop string
# is searched for in the new text of every token, and each stop token id is banned per token until
# min_tokens: bounded, neither can make one request slow down every other.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024  # distinct ids
# A request_id is echoed in every streamed message.
MAX_REQUEST_ID_CHARS = 512
# A constraint (structured outputs): a JSON schema, regex or grammar of at most 1 Mi characters, or
# at most 1024 choices of at most 1024 characters each. Compiled once per distinct constraint.
MAX_CONSTRAINT_CHARS = 1 << 20
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
# A prompt's size before the model's max_model_len is known: a text of up to 4 Mi characters (16
# MiB of UTF-8 at most; about a million tokens) or up to 1 Mi token ids (also the most stop token
# ids a list may hold, repeats included). With the limits above, every request these allow fits in
# MAX_REQUEST_BYTES, which the scheduler's public port accepts (grpc's default is 4 MiB): a request
# too large is refused by the validation, naming its field, never by the transport.
MAX_PROMPT_CHARS = 4 << 20
MAX_TOKEN_IDS = 1 << 20
MAX_REQUEST_BYTES = 32 << 20


def bad_utf8_field(data: bytes, descriptor) -> str | None:
    """The dotted path (`stopping.stop`) of the first string field of `data`, a serialized message
    of type `descriptor`, whose bytes are not UTF-8; None if there is none (or `data` is corrupt in
    another way). protobuf refuses such a message with "String field had bad UTF-8" and no name:
    this names it, so that the refusal can say which field was wrong."""
    from google.protobuf.descriptor import FieldDescriptor

    pos, end = 0, len(data)

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise ValueError("truncated varint")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    try:
        while pos < end:
            key = varint()
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                varint()
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size = varint()
                payload = data[pos : pos + size]
                pos += size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        payload.decode("utf-8")
                    except UnicodeDecodeError:
                        return field.name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = bad_utf8_field(payload, field.message_type)
                    if inner is not None:
                        return f"{field.name}.{inner}"
            else:
                return None
    except ValueError:
        return None
    return None
