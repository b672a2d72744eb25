"""`pagedserve openai`: an OpenAI-compatible HTTP gateway in front of pagedserve schedulers.

    pagedserve openai --port 8000 --scheduler 127.0.0.1:50051 [--scheduler ADDR ...]
    pagedserve openai --scheduler dns:///scheduler:50051 --served-model-name llama

It is stateless: each request becomes one `Generate` stream on the public gRPC API of a scheduler
(round robin, UNAVAILABLE ones skipped), and any number of gateways can run side by side.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events; structured outputs and chat's tool calls as
docs/structured-outputs.md describes), GET /health, GET /metrics. Errors have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 bad request (FastAPI's own 422s included,
and every refusal of the one validation, pagedserve.common.validation, naming the field as
`param`), 404 unknown model or path, 429 the scheduler's queue is full, 503 no scheduler serving;
500 only for a fault of the gateway itself, logged with its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.entrypoints.chat_utils import ChatTemplateError, load_chat_template
from pagedserve.entrypoints.openai.metrics import GatewayMetrics
from pagedserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ModelCard,
    ModelList,
    ToolCall,
)
from pagedserve.entrypoints.openai.schedulers import SchedulerPool
from pagedserve.entrypoints.openai.serving import (
    FINISH_REASONS,
    Gateway,
    GatewayError,
    Generation,
    check_sampling,
    counted,
    from_rpc_error,
    generate_request,
    new_id,
    tool_plan,
    usage_info,
)
from pagedserve.entrypoints.openai.tool_calls import (
    ToolCallDelta,
    ToolCallParser,
    merge_calls,
    new_call_id,
    template_message,
)
from pagedserve.protos import generation_pb2

log = structlog.get_logger()

BodyT = TypeVar("BodyT", bound=BaseModel)
DEFAULT_PORT = 8000
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _validation_error(exc: RequestValidationError | ValidationError) -> GatewayError:
    """pydantic's first complaint, naming the field (`messages.0.role`), as OpenAI's 400."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return GatewayError(400, "the body is not valid JSON", "invalid_request_error")
    return GatewayError(400, f"{param}: {message}" if param else message, "invalid_request_error", param)


async def _parse(raw: Request, model: type[BodyT]) -> BodyT:
    """The request body as `model`, parsed and validated in one pass by pydantic's JSON parser: for a
    prompt of token ids several times faster than FastAPI's json.loads-then-validate, which
    dominated the gateway's time per request under load.

    A body pydantic's parser refuses as JSON is parsed again by Python's, which takes bytes that
    are not UTF-8 (and escaped lone surrogates) as lone surrogates in the strings: the validation
    then names the field they are in, as every door names it, instead of "not valid JSON"."""
    data = await raw.body()
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        if not exc.errors() or exc.errors()[0].get("type") != "json_invalid":
            raise _validation_error(exc) from None
        first = exc
    try:
        parsed = json.loads(data.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        raise _validation_error(first) from None
    try:
        return model.model_validate(parsed)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI description of a body the handler parses itself (see `_parse`)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"content": {"application/json": {"schema": schema}}, "required": True}}


def _json(body: BaseModel) -> Response:
    """A response model as JSON, serialized by pydantic (FastAPI's jsonable_encoder costs ~1 ms)."""
    return Response(body.model_dump_json(), media_type="application/json")


async def _logprob_tokens(gateway: Gateway, token_ids: list[int]) -> list[str]:
    tokenizer = await gateway.tokenizer()
    return [tokenizer.decode([t]) for t in token_ids]


def build_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.pool.start()
        yield
        await gateway.pool.close()

    app = FastAPI(title="pagedserve OpenAI-compatible gateway", lifespan=lifespan)

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (404 no such path, 405 wrong method) in OpenAI's shape."""
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = GatewayError(exc.status_code, str(exc.detail), kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        """A fault of the gateway, never of what the client sent (that is a 4xx above): logged with
        its traceback, answered in OpenAI's shape."""
        log.error("unhandled error", path=request.url.path, exc_info=exc)
        error = GatewayError(500, f"internal error: {type(exc).__name__}", "server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        gateway.metrics.finished(request.url.path, 400, 0.0, None, started=False)
        return JSONResponse(error.body(), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        try:
            await gateway.pool.model_info(timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            return JSONResponse(from_rpc_error(exc).body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Response:
        info = await gateway.model_info()
        name = await gateway.model_name()
        return _json(ModelList(data=[ModelCard(id=name, root=info.model, max_model_len=info.max_model_len)]))

    @app.post(
        "/v1/completions", response_model=CompletionResponse, openapi_extra=_request_body(CompletionRequest)
    )
    async def completions(raw: Request) -> Response:
        endpoint = "/v1/completions"
        with counted(gateway.metrics, endpoint):
            body = await _parse(raw, CompletionRequest)
            request_id = new_id("cmpl")
            request = generate_request(body, request_id)
            model = await gateway.check_model(body.model)
            want_logprobs = body.logprobs is not None
            if want_logprobs:
                await gateway.tokenizer()  # fail before the request runs, not after
            generation = Generation(gateway, endpoint, raw, body.aliases())
            await generation.begin(request)
        if body.stream:
            return StreamingResponse(
                _completion_events(gateway, generation, body, model, request_id),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        done = await generation.collect()
        choice = CompletionChoice(text=done.text, finish_reason=generation.finish_reason)
        if body.return_token_ids:
            choice.token_ids = done.token_ids
        if want_logprobs:
            choice.logprobs = await _completion_logprobs(gateway, done.token_ids, done.logprobs, 0)
        return _json(
            CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage_info(done.usage))
        )

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        openapi_extra=_request_body(ChatCompletionRequest),
    )
    async def chat_completions(raw: Request) -> Response:
        endpoint = "/v1/chat/completions"
        with counted(gateway.metrics, endpoint):
            body = await _parse(raw, ChatCompletionRequest)
            check_sampling(body)
            model = await gateway.check_model(body.model)
            request_id = new_id("chatcmpl")
            tools = tool_plan(body, await gateway.template() if body.tools else None)
            messages = [template_message(m.as_template_input()) for m in body.messages]
            _, prompt_ids = await gateway.chat_prompt(messages, body.tool_dicts)
            request = generate_request(body, request_id, prompt_ids, tools)
            aliases = body.aliases() | ({"structured_outputs": "tools"} if tools.constraint else {})
            generation = Generation(gateway, endpoint, raw, aliases)
            await generation.begin(request)
        if body.stream:
            return StreamingResponse(
                _chat_events(gateway, generation, body, model, request_id, ToolCallParser(tools)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        done = await generation.collect()
        message, finish = _chat_message(ToolCallParser(tools), done.text, generation.finish_reason)
        choice = ChatChoice(message=message, finish_reason=finish)
        if body.logprobs:
            choice.logprobs = await _chat_logprobs(gateway, done.token_ids, done.logprobs)
        return _json(
            ChatCompletionResponse(id=request_id, model=model, choices=[choice], usage=usage_info(done.usage))
        )

    return app


def _tool_calls_finish(finish: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the output ended by itself with calls in it."""
    return "tool_calls" if num_calls and finish == "stop" else finish


def _chat_message(parser: ToolCallParser, text: str, finish: str | None) -> tuple[ChatMessageOut, str | None]:
    """A whole chat output as OpenAI's message: its text, or its tool calls and what text is left."""
    if not parser.active:
        return ChatMessageOut(content=text), finish
    parsed, tail = parser.feed(text), parser.finish()
    calls = merge_calls(parsed.calls + tail.calls)
    content = parsed.content + tail.content
    tool_calls = [
        ToolCall(id=c.id or new_call_id(), function=FunctionCall(name=c.name or "", arguments=c.arguments))
        for c in calls
    ]
    message = ChatMessageOut(content=content or (None if tool_calls else ""), tool_calls=tool_calls or None)
    return message, _tool_calls_finish(finish, len(tool_calls))


def _delta_calls(pieces: list[ToolCallDelta]) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(
            index=p.index,
            id=p.id,
            type="function" if p.id else None,
            function=DeltaFunctionCall(name=p.name, arguments=p.arguments),
        )
        for p in pieces
    ]


async def _completion_logprobs(
    gateway: Gateway, token_ids: list[int], logprobs: list[float], offset: int
) -> CompletionLogProbs:
    tokens = await _logprob_tokens(gateway, token_ids)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogProbs(tokens=tokens, token_logprobs=logprobs, top_logprobs=None, text_offset=offsets)


async def _chat_logprobs(gateway: Gateway, token_ids: list[int], logprobs: list[float]) -> ChatLogProbs:
    tokens = await _logprob_tokens(gateway, token_ids)
    return ChatLogProbs(
        content=[
            ChatLogProb(token=t, logprob=lp, bytes=list(t.encode()))
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    )


async def _completion_events(
    gateway: Gateway, generation: Generation, body: CompletionRequest, model: str, request_id: str
) -> AsyncIterator[str]:
    created = int(generation.created)
    tokenizer = await gateway.tokenizer() if body.logprobs is not None else None
    offset = 0

    def chunks(message: generation_pb2.GenerateResponse) -> list[str]:
        nonlocal offset
        finish = FINISH_REASONS.get(message.finish_reason)
        if not message.text and not message.token_ids and finish is None:
            return []
        choice = CompletionChoice(text=message.text, finish_reason=finish)
        if body.return_token_ids:
            choice.token_ids = list(message.token_ids)
        if tokenizer is not None:
            tokens = [tokenizer.decode([t]) for t in message.token_ids]
            offsets = []
            for token in tokens:
                offsets.append(offset)
                offset += len(token)
            choice.logprobs = CompletionLogProbs(
                tokens=tokens, token_logprobs=list(message.logprobs), text_offset=offsets
            )
        out = [
            CompletionChunk(id=request_id, created=created, model=model, choices=[choice]).model_dump_json()
        ]
        if finish is not None and body.include_usage:
            usage = usage_info(message.usage)
            out.append(
                CompletionChunk(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                ).model_dump_json()
            )
        return out

    async for event in generation.sse(chunks):
        yield event


async def _chat_events(
    gateway: Gateway,
    generation: Generation,
    body: ChatCompletionRequest,
    model: str,
    request_id: str,
    parser: ToolCallParser,
) -> AsyncIterator[str]:
    created = int(generation.created)
    tokenizer = await gateway.tokenizer() if body.logprobs else None
    first = True

    def chunk(delta: DeltaMessage, finish: str | None = None, logprobs: ChatLogProbs | None = None) -> str:
        choice = ChatStreamChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=[choice]
        ).model_dump_json()

    def chunks(message: generation_pb2.GenerateResponse) -> list[str]:
        nonlocal first
        out = []
        if first:  # OpenAI's first chunk names the role
            out.append(chunk(DeltaMessage(role="assistant", content="")))
            first = False
        finish = FINISH_REASONS.get(message.finish_reason)
        logprobs = None
        if tokenizer is not None and message.token_ids:
            logprobs = ChatLogProbs(
                content=[
                    ChatLogProb(token=(t := tokenizer.decode([i])), logprob=lp, bytes=list(t.encode()))
                    for i, lp in zip(message.token_ids, message.logprobs, strict=True)
                ]
            )
        content, calls = message.text, []
        if parser.active:
            parsed = parser.feed(message.text)
            if finish is not None:
                tail = parser.finish()
                parsed.content += tail.content
                parsed.calls += tail.calls
                finish = _tool_calls_finish(finish, parser.num_calls)
            content, calls = parsed.content, _delta_calls(parsed.calls)
        if calls:
            out.append(chunk(DeltaMessage(content=content or None, tool_calls=calls), None, logprobs))
            logprobs, content = None, ""
        if content or logprobs is not None or finish is not None:
            out.append(chunk(DeltaMessage(content=content or None), finish, logprobs))
        if finish is not None and body.include_usage:
            usage = usage_info(message.usage)
            out.append(
                ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                ).model_dump_json()
            )
        return out

    async for event in generation.sse(chunks):
        yield event


# ---- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve openai",
        description="OpenAI-compatible HTTP gateway in front of pagedserve schedulers",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    p.add_argument(
        "--scheduler", action="append", default=None, metavar="ADDR",
        help="a scheduler's public address host:port, or dns:///name:port (every address of the "
        "name, round robin); repeatable (default 127.0.0.1:50051)",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the model's name (default: its directory's)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from pagedserve.common.logs import configure_logging

    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    try:
        chat_template = load_chat_template(args.chat_template)
    except ChatTemplateError as exc:
        parser.error(f"--chat-template: {exc}")
    configure_logging("openai")
    gateway = Gateway(
        pool=SchedulerPool(args.scheduler or ["127.0.0.1:50051"]),
        metrics=GatewayMetrics(),
        served_model_name=args.served_model_name,
        tokenizer_dir=args.tokenizer,
        chat_template=chat_template,
    )
    uvicorn.run(
        build_app(gateway), host=args.host, port=args.port, log_level=args.log_level, access_log=False
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
