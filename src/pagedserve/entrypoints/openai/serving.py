"""OpenAI requests to `GenerateRequest`s and the schedulers' deltas back to OpenAI responses.

A request reaches a scheduler before any byte of the response is sent, so every refusal (a bad
field, an unknown model, no scheduler, a full queue) is an HTTP status with OpenAI's error body,
streamed or not. A client that goes away cancels its gRPC stream: the scheduler aborts the request
and frees its KV blocks at once, whether or not a token was due.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from starlette.requests import Request

from pagedserve.common.validation import (
    InvalidRequest,
    check_fields,
    field_named,
    to_proto,
    validate_request,
)
from pagedserve.entrypoints.chat_utils import ChatTemplateError, render_chat
from pagedserve.entrypoints.openai.metrics import GatewayMetrics
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest, UsageInfo
from pagedserve.entrypoints.openai.schedulers import NoScheduler, SchedulerPool
from pagedserve.entrypoints.openai.tool_calls import (
    ToolChoiceError,
    ToolPlan,
    plan_tools,
    template_declares_tools,
)
from pagedserve.protos import generation_pb2

log = structlog.get_logger()

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
# A scheduler's status for a request, as HTTP status and OpenAI error type.
_RPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class GatewayError(Exception):
    """A request the gateway answers with an error: OpenAI's body and an HTTP status."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param)


def from_rpc_error(exc: grpc.aio.AioRpcError, aliases: Mapping[str, str] | None = None) -> GatewayError:
    """The scheduler's status as the gateway's error; INVALID_ARGUMENT keeps the scheduler's message,
    whose first word names the field (`max_tokens: ...`): `param` is that field, by the name the
    body gave it (`aliases`: chat's prompt is its `messages`)."""
    status, kind = _RPC_STATUS.get(exc.code(), (500, "server_error"))
    message = exc.details() or exc.code().name
    param = None
    if status == 400 and (name := field_named(message)) is not None:
        param = (aliases or {}).get(name, name)
        message = param + message[len(name) :]  # chat's "messages: has 2000 tokens, more than ..."
    if status == 503:
        message = f"no scheduler is serving: {message}"
    return GatewayError(status, message, kind, param, exc.code().name)


def invalid_request(exc: InvalidRequest, aliases: Mapping[str, str] | None = None) -> GatewayError:
    """A refusal of the one validation as OpenAI's 400, naming the field by the body's name for it."""
    param = (aliases or {}).get(exc.field, exc.field)
    return bad_request(f"{param}: {exc.reason}", param)


def no_scheduler(exc: Exception) -> GatewayError:
    return GatewayError(503, f"no scheduler is serving: {exc}", "service_unavailable_error")


@dataclass
class Gateway:
    """What every handler shares: the schedulers, the model's names, its tokenizer, the metrics."""

    pool: SchedulerPool
    metrics: GatewayMetrics
    served_model_name: str | None = None
    tokenizer_dir: str | None = None
    chat_template: str | None = None
    _info: generation_pb2.ModelInfo | None = None
    _tokenizer: Any = None
    _tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def model_info(self) -> generation_pb2.ModelInfo:
        """The schedulers' model (asked once, then remembered: a gateway serves one model)."""
        if self._info is None:
            try:
                self._info = await self.pool.model_info()
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
        return self._info

    async def model_name(self) -> str:
        """--served-model-name, else the name of the model directory the schedulers serve."""
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename((await self.model_info()).model.rstrip("/")) or "default"

    async def check_model(self, requested: str | None) -> str:
        name = await self.model_name()
        if requested is not None and requested != name:
            raise GatewayError(
                404, f"The model `{requested}` does not exist (this server serves `{name}`).",
                "invalid_request_error", "model", "model_not_found",
            )  # fmt: skip
        return name

    async def tokenizer(self) -> Any:
        """The model's tokenizer (chat templates, logprob tokens): --tokenizer, else the model
        directory GetModelInfo names; loaded once, off the event loop."""
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                source = self.tokenizer_dir or (await self.model_info()).model
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, source)
                except Exception as exc:
                    raise GatewayError(
                        500, f"the gateway cannot load the tokenizer of {source!r} ({exc}); start it with "
                        "--tokenizer DIR", "server_error",
                    ) from None  # fmt: skip
            return self._tokenizer

    async def template(self) -> str | None:
        """The chat template requests are rendered with (--chat-template, else the tokenizer's)."""
        return self.chat_template or getattr(await self.tokenizer(), "chat_template", None)

    async def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[int]]:
        tokenizer = await self.tokenizer()
        try:
            return await asyncio.to_thread(render_chat, tokenizer, messages, self.chat_template, tools)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None


def generate_request(
    body: SamplingRequest,
    request_id: str,
    prompt: str | list[int] | None = None,
    tools: ToolPlan | None = None,
) -> generation_pb2.GenerateRequest:
    """The body as a GenerateRequest, through the one validation every door runs (`prompt`: the
    chat's rendered prompt; a completion's is its body's own; `tools`: chat's tool plan, whose
    constraint is the request's)."""
    aliases = body.aliases()
    try:
        values = body.request_values() | {"request_id": request_id}
        if prompt is not None:
            values["prompt"] = prompt
        if tools is not None and tools.constraint is not None:
            values["structured_outputs"] = tools.constraint | body.constraint_options()
            aliases = aliases | {"structured_outputs": "tools"}
        return to_proto(validate_request(values))
    except InvalidRequest as exc:
        raise invalid_request(exc, aliases) from None


def check_sampling(body: SamplingRequest) -> None:
    """The body's fields other than the prompt, before the chat template renders one."""
    try:
        check_fields({k: v for k, v in body.request_values().items() if k != "prompt"})
    except InvalidRequest as exc:
        raise invalid_request(exc, body.aliases()) from None


def tool_plan(body: ChatCompletionRequest, template: str | None) -> ToolPlan:
    """What the chat's `tools` and `tool_choice` ask (see tool_calls.py), as a 400 if nothing."""
    try:
        plan = plan_tools(
            body.tool_dicts, body.tool_choice, body.parallel_tool_calls, template_declares_tools(template)
        )
    except ToolChoiceError as exc:
        raise bad_request(str(exc), exc.param) from None
    if plan.constraint is not None:
        try:
            other = next(iter(body.constraint_sources()), None)
        except InvalidRequest:
            other = "response_format"
        if other is not None:
            raise bad_request(
                f"tool_choice: {plan.mode} tool calls cannot be combined with {other}", "tool_choice"
            )
    return plan


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_info(usage: generation_pb2.Usage) -> UsageInfo:
    from pagedserve.entrypoints.openai.protocol import PromptTokensDetails

    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
    )


@dataclass
class Completed:
    """A whole generation, for a non-streamed response."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    usage: generation_pb2.Usage


class Generation:
    """One request's gRPC stream, from its first message to its last, cancelled if the HTTP client
    goes away (a watcher on the ASGI receive channel) or the handler ends early."""

    def __init__(
        self, gateway: Gateway, endpoint: str, raw: Request, aliases: Mapping[str, str] | None = None
    ) -> None:
        self.gateway, self.endpoint, self.raw, self.aliases = gateway, endpoint, raw, aliases
        self.start = time.perf_counter()
        self.created = time.time()
        self.finish_reason: str | None = None
        self.call: grpc.aio.UnaryStreamCall | None = None
        self.first: generation_pb2.GenerateResponse | None = None
        self.disconnected = False
        self._watcher: asyncio.Task | None = None

    async def begin(self, request: generation_pb2.GenerateRequest) -> None:
        try:
            self.call, self.first = await self.gateway.pool.generate(request)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self.aliases) from None
        except NoScheduler as exc:
            raise no_scheduler(exc) from None
        self.gateway.metrics.first_token(self.endpoint, time.perf_counter() - self.start)
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.raw.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if self.call is not None:
            self.call.cancel()  # the scheduler aborts the request and frees its blocks

    async def messages(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Every message of the stream, the first included, until the one with a finish reason.
        Raises GatewayError for a status mid-stream, CancelledError once the client has gone."""
        assert self.call is not None and self.first is not None
        message = self.first
        while True:
            if message.finish_reason:
                self.finish_reason = FINISH_REASONS.get(message.finish_reason, "stop")
            yield message
            if message.finish_reason:
                return
            try:
                message = await self.call.read()
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, self.aliases) from None
            if message is grpc.aio.EOF:
                raise GatewayError(502, "the scheduler ended the stream early", "server_error")

    def close(self, status: int, usage: generation_pb2.Usage | None = None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.call is not None:
            self.call.cancel()  # no-op once finished
        self.call = None
        self.gateway.metrics.finished(self.endpoint, status, time.perf_counter() - self.start, usage)

    async def collect(self) -> Completed:
        """Reads the whole stream (non-streamed responses)."""
        status, usage = 500, None
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[float] = []
        try:
            async for message in self.messages():
                text.append(message.text)
                token_ids.extend(message.token_ids)
                logprobs.extend(message.logprobs)
            usage, status = message.usage, 200
            return Completed("".join(text), token_ids, logprobs, usage)
        except asyncio.CancelledError:
            status = 499
            if self.disconnected:
                raise GatewayError(499, "the client closed the request", "client_closed_request") from None
            raise
        except GatewayError as exc:
            status = exc.status
            raise
        finally:
            self.close(status, usage)

    async def sse(self, chunks: Callable[[generation_pb2.GenerateResponse], list[str]]) -> AsyncIterator[str]:
        """The stream as server-sent events: `chunks` turns each message into JSON payloads; an
        error mid-stream is sent as an event with OpenAI's error body; then `data: [DONE]`."""
        status, usage = 500, None
        try:
            async for message in self.messages():
                for payload in chunks(message):
                    yield f"data: {payload}\n\n"
            usage, status = message.usage, 200
        except GatewayError as exc:
            status = exc.status
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:  # a fault of the gateway: the headers are sent, so as an event
            log.error("unhandled error in a stream", endpoint=self.endpoint, exc_info=exc)
            error = GatewayError(500, f"internal error: {type(exc).__name__}", "server_error")
            yield f"data: {json.dumps(error.body())}\n\n"
        except asyncio.CancelledError:
            status = 499
            if not self.disconnected:
                raise
            return
        finally:
            self.close(status, usage)
        yield "data: [DONE]\n\n"


@contextlib.contextmanager
def counted(metrics: GatewayMetrics, endpoint: str):
    """Counts a request refused before it reached a scheduler."""
    start = time.perf_counter()
    try:
        yield
    except GatewayError as exc:
        metrics.finished(endpoint, exc.status, time.perf_counter() - start, None, started=False)
        raise
