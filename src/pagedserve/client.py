"""A small client of the public API, used by `pagedserve generate`, the health check and tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pagedserve.common.validation import to_proto, validate_request
from pagedserve.protos import generation_pb2, generation_pb2_grpc


@dataclass
class Completion:
    """A whole streamed completion, assembled from its deltas."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    usage: generation_pb2.Usage | None = None
    num_messages: int = 0


def make_request(
    prompt: str | list[int],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    priority: int = 0,
    return_logprobs: bool = False,
    request_id: str = "",
    structured_outputs: dict | None = None,
) -> generation_pb2.GenerateRequest:
    """Builds a GenerateRequest; None leaves a field unset (the server's default). Raises
    InvalidRequest (a ValueError) naming the field for a value the server would refuse, or that
    its wire type cannot carry (the one validation, pagedserve.common.validation).
    `structured_outputs`: a constraint, e.g. `{"json": schema}` or `{"regex": "[0-9]+"}`."""
    return to_proto(
        validate_request(
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "seed": seed,
                "stop": stop,
                "stop_token_ids": stop_token_ids,
                "ignore_eos": ignore_eos,
                "min_tokens": min_tokens,
                "priority": priority,
                "logprobs": 0 if return_logprobs else None,
                "request_id": request_id,
                "structured_outputs": structured_outputs,
            }
        )
    )


def stream(
    channel: grpc.Channel, request: generation_pb2.GenerateRequest, timeout: float | None = None
) -> Iterator[generation_pb2.GenerateResponse]:
    """Yields the server's responses as they arrive."""
    return generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout)


def generate(
    channel: grpc.Channel, request: generation_pb2.GenerateRequest, timeout: float | None = None
) -> Completion:
    """Runs a request to the end and assembles its completion."""
    result = Completion()
    for response in stream(channel, request, timeout):
        result.request_id = response.request_id
        result.token_ids.extend(response.token_ids)
        result.text += response.text
        result.logprobs.extend(response.logprobs)
        result.num_messages += 1
        if response.finish_reason:
            result.finish_reason = generation_pb2.FinishReason.Name(response.finish_reason)
            result.usage = response.usage
    return result
