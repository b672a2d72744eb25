"""The public gRPC API (`pagedserve.v1.Generation`): validation, status codes and streaming.

Every bad input is refused with INVALID_ARGUMENT and a message naming what was wrong (bytes that do
not parse as the request message included); UNAVAILABLE before any executor has attached (the
model's limits are unknown) and when the scheduler stops; RESOURCE_EXHAUSTED when the engine holds
--max-queue-len requests. While executors come and go, requests wait in the engine for one
(scheduler/engine.py). A client that cancels its stream aborts its request, whose blocks return to
the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import structlog
from google.protobuf.message import DecodeError

from pagedserve.common.flags import listen
from pagedserve.protos import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from pagedserve.scheduler.completion import Delta, StopConditions
from pagedserve.scheduler.engine import (
    ActiveRequest,
    Engine,
    EngineFull,
    EngineUnavailable,
    ExecutorInfo,
    ExecutorStatusView,
)
from pagedserve.scheduler.request import SamplingOptions
from pagedserve.scheduler.service_config import ServiceConfig

log = structlog.get_logger()


class InvalidRequest(ValueError):
    """A GenerateRequest that can never be served; the message says why."""


def sampling_options(request: generation_pb2.GenerateRequest) -> SamplingOptions:
    s = request.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    top_k = s.top_k if s.HasField("top_k") else 0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temperature}")
    if not (0 < top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {top_k}")
    return SamplingOptions(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=s.seed if s.HasField("seed") else None,
        return_logprobs=request.return_logprobs,
    )


def stop_conditions(
    request: generation_pb2.GenerateRequest, num_prompt_tokens: int, info: ExecutorInfo
) -> StopConditions:
    st = request.stopping
    room = info.max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {num_prompt_tokens} tokens; max_model_len is {info.max_model_len}, "
            "which leaves no room to generate"
        )
    max_tokens = st.max_tokens if st.HasField("max_tokens") else room
    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if max_tokens > room:
        raise InvalidRequest(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len ({info.max_model_len})"
        )
    if st.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({st.min_tokens}) exceeds max_tokens ({max_tokens})")
    if any(s == "" for s in st.stop):
        raise InvalidRequest("stop strings must not be empty")
    bad_ids = [i for i in st.stop_token_ids if i >= info.vocab_size]
    if bad_ids:
        raise InvalidRequest(f"stop_token_ids {bad_ids} are outside the vocabulary (size {info.vocab_size})")
    stop_ids = set(st.stop_token_ids)
    if not st.ignore_eos:
        stop_ids.update(info.eos_token_ids)
    return StopConditions(
        max_tokens=max_tokens,
        min_tokens=st.min_tokens,
        stop_strings=tuple(st.stop),
        stop_token_ids=frozenset(stop_ids),
    )


def to_response(request_id: str, delta: Delta) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=delta.logprobs,
        finish_reason=int(delta.finish_reason or 0),
    )


async def next_delta(queue: asyncio.Queue[Delta | Exception]) -> Delta:
    """The next message for a client: every delta queued so far folded into one (a client that
    fell behind gets fewer, larger messages). Raises the error the engine queued, if any."""
    merged = await queue.get()
    while isinstance(merged, Delta) and not queue.empty() and merged.finish_reason is None:
        nxt = queue.get_nowait()
        if isinstance(nxt, Exception):
            raise nxt
        merged = merged.merged(nxt)
    if isinstance(merged, Exception):
        raise merged
    return merged


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _info(self) -> ExecutorInfo:
        """The model's limits, to validate a request against: known once an executor attached
        (kept while none is: the request then waits for one)."""
        info = self.engine.model_info()
        if info is None:
            raise EngineUnavailable("no executor has attached yet")
        return info

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        code = {
            InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
            EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
            EngineFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
        }[type(exc)]
        await context.abort(code, str(exc))

    async def _encode(self, text: str) -> list[int]:
        """Tokenizes on a worker thread: a text of megabytes takes seconds to encode (the Rust
        tokenizer releases the GIL meanwhile), and on the event loop it would stall every stream."""
        return list(await asyncio.to_thread(self.engine.tokenizer.encode, text))

    async def _request_ids(self, request: generation_pb2.GenerateRequest) -> list[int]:
        """The prompt as token ids: the request's own, or its text tokenized."""
        which = request.WhichOneof("prompt")
        if which == "text":
            return await self._encode(request.text)
        return list(request.token_ids.ids) if which == "token_ids" else []

    def _check_prompt(self, ids: list[int], info: ExecutorInfo) -> None:
        """Checks the prompt's token ids (from the text or the request) against the model."""
        if not ids:
            raise InvalidRequest("the prompt is empty")
        bad = [i for i in ids if i >= info.vocab_size]  # a tokenizer larger than the model, too
        if bad:
            raise InvalidRequest(
                f"prompt token ids {bad[:8]} are outside the vocabulary (size {info.vocab_size})"
            )
        if len(ids) > info.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({info.max_model_len})"
            )

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids = await self._request_ids(request)
            info = self._info()  # after tokenizing: the executor may have changed meanwhile
            self._check_prompt(prompt_ids, info)
            active = self.engine.submit(
                request_id,
                prompt_ids,
                sampling_options(request),
                stop_conditions(request, len(prompt_ids), info),
                priority=request.priority,
            )
        except (InvalidRequest, EngineUnavailable, EngineFull) as exc:
            await self._abort(context, exc)
            return
        try:
            async for response in self._stream(active):
                yield response
        except EngineUnavailable as exc:
            await self._abort(context, exc)
        finally:
            self.engine.abort(active)  # no-op once finished; frees the blocks of a cancelled stream

    async def _stream(self, active: ActiveRequest) -> AsyncIterator[generation_pb2.GenerateResponse]:
        while True:
            item = await next_delta(active.deltas)
            response = to_response(active.request_id, item)
            if item.finish_reason is not None:
                request = active.request
                response.usage.prompt_tokens = len(request.prompt_token_ids)
                response.usage.completion_tokens = active.completion.num_tokens
                response.usage.cached_prompt_tokens = request.num_cached_prompt_tokens
                yield response
                return
            yield response

    async def Tokenize(self, request, context):
        return generation_pb2.TokenizeResponse(ids=await self._encode(request.text))

    async def GetModelInfo(self, request, context):
        info = self.engine.model_info()
        if info is None or not self.engine.is_serving:  # what health checks probe: serving now
            await self._abort(context, EngineUnavailable("no executor is attached"))
            return
        return generation_pb2.ModelInfo(
            model=info.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_gpu_blocks=info.num_gpu_blocks,
            eos_token_id=info.eos_token_ids[0] if info.eos_token_ids else 0,
        )


class AdminService(admin_pb2_grpc.AdminServicer):
    """Counters of the scheduling cores (summed over executors) and the executors themselves, for
    operators, tests and `pagedserve bench`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def GetStats(self, request, context):
        stats = admin_pb2.SchedulerStats(
            steps=self.engine.steps,
            tokens_generated=self.engine.tokens_generated,
            num_active_requests=self.engine.num_active_requests,
        )
        core = self.engine.core_stats()
        for f in dataclasses.fields(core):
            if f.name in admin_pb2.SchedulerStats.DESCRIPTOR.fields_by_name:
                setattr(stats, f.name, getattr(core, f.name))
        return stats

    async def ListExecutors(self, request, context):
        return admin_pb2.ListExecutorsResponse(
            executors=[executor_status(view) for view in self.engine.executor_statuses()]
        )


def executor_status(view: ExecutorStatusView) -> admin_pb2.ExecutorStatus:
    """The proto fields of a view (steps and busy_seconds are not on the wire)."""
    names = admin_pb2.ExecutorStatus.DESCRIPTOR.fields_by_name
    return admin_pb2.ExecutorStatus(
        **{f.name: getattr(view, f.name) for f in dataclasses.fields(view) if f.name in names}
    )


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Refuses request bytes that do not parse with INVALID_ARGUMENT; grpc itself answers UNKNOWN,
    the code for server faults. Each unary-request handler gets the raw bytes and parses them
    itself, where it can abort with a status."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize, serialize = handler.request_deserializer, handler.response_serializer

        async def parse(data: bytes, context: grpc.aio.ServicerContext):
            try:
                return deserialize(data)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")

        if handler.unary_stream:
            behavior = handler.unary_stream

            async def unary_stream(data: bytes, context: grpc.aio.ServicerContext):
                # aclosing: a cancelled stream closes the inner handler too, running its cleanup now.
                async with contextlib.aclosing(behavior(await parse(data, context), context)) as responses:
                    async for response in responses:
                        yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)
        behavior = handler.unary_unary

        async def unary_unary(data: bytes, context: grpc.aio.ServicerContext):
            return await behavior(await parse(data, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)


def public_server(generation: GenerationService, admin: AdminService | None = None) -> grpc.aio.Server:
    """The server of the public API (ports not yet added); the hot-path bench serves through it too."""
    # so_reuseport off: a second scheduler on a port in use fails instead of sharing it.
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()], options=[("grpc.so_reuseport", 0)])
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    if admin is not None:
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
    return server


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


async def serve_async(config: ServiceConfig) -> None:
    """Serves the public API until SIGINT/SIGTERM; the engine attaches to the executor meanwhile."""
    engine = Engine(config, load_tokenizer(config.model))
    # What is alive now (modules, the tokenizer) lives as long as the process: out of the cyclic
    # GC's sight, a full collection no longer scans ~300k objects and stalls a step (100+ ms).
    gc.collect()
    gc.freeze()
    server = public_server(GenerationService(engine), AdminService(engine))
    address = f"{config.host}:{config.port}"
    listen(server, address)
    await server.start()
    log.info("scheduler listening", address=address, executors=list(config.executors))
    engine_task = asyncio.create_task(engine.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([engine_task, stopped], return_when=asyncio.FIRST_COMPLETED)
    log.info("scheduler stopping")
    engine_task.cancel()
    await server.stop(grace=2.0)
    if engine_task.done() and not engine_task.cancelled() and engine_task.exception():
        raise engine_task.exception()


def serve(config: ServiceConfig) -> None:
    asyncio.run(serve_async(config))
