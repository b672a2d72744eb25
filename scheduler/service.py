"""The public gRPC API (`pagedserve.v1.Generation`): validation, status codes and streaming.

Every bad input is refused with INVALID_ARGUMENT and a message that starts with the field it names
(`max_tokens: ...`): the one validation every door runs (pagedserve.common.validation), then what
needs the model (scheduler/admission.py) and, for structured outputs, the compile of the request's
grammar (scheduler/structured.py: awaited by this request alone); bytes that do not parse as the
request message are refused too (a string that is not UTF-8 named as its field). UNAVAILABLE
before any executor has attached (the model's limits are unknown), while the scheduler drains and
when it stops; RESOURCE_EXHAUSTED when the engine holds --max-queue-len requests. While executors
come and go, requests wait in the engine for one (scheduler/engine.py). A client that cancels its stream, or
whose deadline passes (grpc.aio cancels the handler then), aborts its request, whose blocks return
to the pool at once. The public port serves TLS with --ssl-certfile/--ssl-keyfile (mTLS with
--ssl-ca-certs), and --client-rate-limit throttles each client (scheduler/throttle.py).

Beside Generation and Admin the port serves grpc.health.v1 (scheduler/monitor.py) and server
reflection. On SIGTERM the scheduler drains: health NOT_SERVING, new streams refused, running ones
given --shutdown-grace seconds to finish, then the executors' leases given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import inspect
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.common.auth import warn_if_open
from pagedserve.common.flags import listen
from pagedserve.common.metrics_http import serve_metrics
from pagedserve.common.request_log import RequestLogRecord
from pagedserve.common.validation import (
    InvalidRequest,
    RequestParams,
    field_of_wire_path,
    validate_request,
    values_from_proto,
)
from pagedserve.protos import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc, wire
from pagedserve.scheduler import monitor
from pagedserve.scheduler.admission import check_prompt, sampling_options, stop_conditions
from pagedserve.scheduler.completion import Delta
from pagedserve.scheduler.engine import (
    ActiveRequest,
    Engine,
    EngineFull,
    EngineUnavailable,
    ExecutorInfo,
    ExecutorStatusView,
)
from pagedserve.scheduler.metrics import SchedulerMetrics, StreamMetrics, read_on_loop
from pagedserve.scheduler.request_log import RequestLog
from pagedserve.scheduler.service_config import ServiceConfig
from pagedserve.scheduler.throttle import ClientThrottle, ThrottleInterceptor
from pagedserve.scheduler.transport import ChannelSecurity, GrpcTransport

log = structlog.get_logger()


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


class Draining(Exception):
    """The scheduler is shutting down: it takes no new stream."""


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self, engine: Engine, metrics: SchedulerMetrics | None = None, request_log: RequestLog | None = None
    ) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else SchedulerMetrics(engine, model_name(engine.config))
        self.request_log = request_log
        self.draining = False
        self._num_streams = 0  # Generate calls between submission and their end
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    @property
    def num_streams(self) -> int:
        return self._num_streams

    async def wait_for_streams(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for every running stream to end; returns whether they did."""
        try:
            await asyncio.wait_for(self._no_streams.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _check_not_draining(self) -> None:
        if self.draining:
            raise Draining("the scheduler is draining (shutting down); retry on another one")

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
            Draining: grpc.StatusCode.UNAVAILABLE,
            EngineFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
        }[type(exc)]
        await context.abort(code, str(exc))

    async def _encode(self, text: str) -> list[int]:
        """Tokenizes on a worker thread: a text of megabytes takes seconds to encode (the Rust
        tokenizer releases the GIL meanwhile), and on the event loop it would stall every stream."""
        return list(await asyncio.to_thread(self.engine.tokenizer.encode, text))

    async def _prompt_ids(self, params: RequestParams) -> list[int]:
        """The prompt as token ids: the request's own, or its text tokenized."""
        if isinstance(params.prompt, str):
            return await self._encode(params.prompt)
        return list(params.prompt)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            params = validate_request(values_from_proto(request))  # the one validation every door runs
            self._check_not_draining()
            prompt_ids = await self._prompt_ids(params)
            self._check_not_draining()  # tokenizing takes time: the drain may have begun meanwhile
            info = self._info()  # after tokenizing: the executor may have changed meanwhile
            check_prompt(prompt_ids, info)
            stop = stop_conditions(params, len(prompt_ids), info)
            grammar = None
            if params.structured_outputs is not None:  # this request alone waits for its compile
                grammar = await self.engine.compile_grammar(params.structured_outputs)
                self._check_not_draining()
            active = self.engine.submit(
                request_id, prompt_ids, sampling_options(params), stop, params.priority, grammar
            )
        except (InvalidRequest, EngineUnavailable, EngineFull, Draining) as exc:
            await self._abort(context, exc)
            return
        self._num_streams += 1
        self._no_streams.clear()
        recorder = self.metrics.stream(arrival)
        log_text = self.request_log is not None and self.request_log.include_text
        texts: list[str] = []
        try:
            async for response in self._stream(active, recorder):
                if log_text:
                    texts.append(response.text)
                yield response
        except EngineUnavailable as exc:
            await self._abort(context, exc)
        finally:
            self.engine.abort(active)  # no-op once finished; frees the blocks of a cancelled stream
            recorder.ended(active.request, None)  # no-op once recorded as finished
            if self.request_log is not None:
                text = "".join(texts) if log_text else None
                self._log_request(active, arrival, recorder.first_token_time, text)
            self._num_streams -= 1
            if not self._num_streams:
                self._no_streams.set()

    def _log_request(
        self, active: ActiveRequest, arrival: float, first_token_time: float | None, text: str | None
    ) -> None:
        """Queues the finished request's line for --request-log (the writer thread hashes it)."""
        now = time.monotonic()
        request, reason = active.request, active.completion.finish_reason
        info = self.engine.model_info()
        record = RequestLogRecord(
            request_id=active.request_id,
            arrival_time=time.time() - (now - arrival),
            prompt_len=request.num_prompt_tokens,
            output_len=active.completion.num_tokens,
            priority=request.priority,
            finish_reason="abort" if reason is None else reason.name.lower(),
            ttft_s=None if first_token_time is None else first_token_time - arrival,
            e2e_s=now - arrival,
            cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
            block_size=info.block_size if info is not None else 16,
        )
        self.request_log.record(record, request.prompt_token_ids, text)

    async def _stream(
        self, active: ActiveRequest, recorder: StreamMetrics | None = None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's deltas as responses; each is counted by `recorder` as it goes out."""
        if recorder is None:
            recorder = self.metrics.stream(active.request.arrival_time)
        while True:
            item = await next_delta(active.deltas)
            response = to_response(active.request_id, item)
            recorder.sent(len(item.token_ids), active.request)
            if item.finish_reason is not None:
                request = active.request
                response.usage.prompt_tokens = len(request.prompt_token_ids)
                response.usage.completion_tokens = active.completion.num_tokens
                response.usage.cached_prompt_tokens = request.num_cached_prompt_tokens
                response.usage.cpu_cached_prompt_tokens = request.num_cpu_cached_prompt_tokens
                recorder.ended(request, item.finish_reason)
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
            num_steps_in_flight=self.engine.num_steps_in_flight,
            process_cpu_seconds=time.process_time(),  # what a scheduler costs per step (bench)
        )
        core = self.engine.core_stats()
        for f in dataclasses.fields(core):
            field = admin_pb2.SchedulerStats.DESCRIPTOR.fields_by_name.get(f.name)
            if field is not None and field.is_repeated:
                getattr(stats, f.name).extend(getattr(core, f.name))
            elif field is not None:
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


def _request_types() -> dict[str, Any]:
    """Each public method's request type, by the method's path (`/pagedserve.v1.Generation/Generate`)."""
    types = {}
    for file in (generation_pb2.DESCRIPTOR, admin_pb2.DESCRIPTOR):
        for service in file.services_by_name.values():
            for method in service.methods:
                types[f"/{service.full_name}/{method.name}"] = method.input_type
    return types


_REQUEST_TYPES = _request_types()


def malformed_message(method: str, data: bytes, exc: DecodeError) -> str:
    """Why request bytes did not parse. A string that is not UTF-8 is named as the field it is
    (`prompt: is not valid UTF-8`), as every door names it; other corrupt bytes are "malformed"."""
    descriptor = _REQUEST_TYPES.get(method)
    path = wire.bad_utf8_field(data, descriptor) if descriptor is not None else None
    if path is None:
        return f"malformed request: {exc}"
    name = field_of_wire_path(path) if descriptor is generation_pb2.GenerateRequest.DESCRIPTOR else path
    return f"{name}: is not valid UTF-8 (the request's field {path})"


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
        method = handler_call_details.method

        async def parse(data: bytes, context: grpc.aio.ServicerContext):
            try:
                return deserialize(data)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed_message(method, data, exc))

        if handler.unary_stream and not inspect.isasyncgenfunction(handler.unary_stream):
            writer = handler.unary_stream  # streams with context.write() (grpc.health.v1's Watch)

            async def unary_stream_writer(data: bytes, context: grpc.aio.ServicerContext) -> None:
                await writer(await parse(data, context), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, response_serializer=serialize)
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


def public_server(
    generation: GenerationService,
    admin: AdminService | None = None,
    health: health_pb2_grpc.HealthServicer | None = None,
    throttle: ClientThrottle | None = None,
) -> grpc.aio.Server:
    """The server of the public API (ports not yet added), with server reflection listing its
    services; the hot-path bench serves through it too. With `throttle`, Generate and Tokenize wait
    for their client's turn (scheduler/throttle.py)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
    if throttle is not None:
        interceptors.append(ThrottleInterceptor(throttle))
    # so_reuseport off: a second scheduler on a port in use fails instead of sharing it.
    # A request the validation allows always fits in MAX_REQUEST_BYTES (grpc's default is 4 MiB).
    options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", wire.MAX_REQUEST_BYTES)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    services = [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]
    if admin is not None:
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        services.append(admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name)
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        services.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection([*services, reflection.SERVICE_NAME], server)
    return server


def model_name(config: ServiceConfig) -> str:
    """The `model_name` label of the metrics: --served-model-name, else --model (as vLLM's)."""
    return config.served_model_name or config.model


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


async def serve_async(config: ServiceConfig) -> None:
    """Serves the public API until SIGINT/SIGTERM, then drains; the engine attaches to the executor
    meanwhile."""
    # The token and TLS files first: a bad one is an error at once, not after the tokenizer loaded.
    security = ChannelSecurity.from_config(config)
    tls = config.server_tls()
    credentials = None if tls is None else tls.credentials()
    warn_if_open(security.token, "scheduler")
    engine = Engine(config, load_tokenizer(config.model), lambda address: GrpcTransport(address, security))
    # What is alive now (modules, the tokenizer) lives as long as the process: out of the cyclic
    # GC's sight, a full collection no longer scans ~300k objects and stalls a step (100+ ms).
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    metrics = SchedulerMetrics(
        engine,
        model_name(config),
        max_model_len=config.max_model_len,
        on_loop=lambda read: read_on_loop(loop, read),  # scrapes run on prometheus_client's thread
    )
    request_log = None
    if config.request_log:
        request_log = RequestLog(config.request_log, engine.tokenizer, config.request_log_text)
    generation = GenerationService(engine, metrics, request_log)
    health = monitor.SchedulerHealth()
    await health.publish(engine.is_serving)  # NOT_SERVING until an executor is attached
    throttle = None
    if config.client_rate_limit is not None:
        throttle = ClientThrottle(config.client_rate_limit, max_waiting=config.max_queue_len)
    server = public_server(generation, AdminService(engine), health.servicer, throttle)
    address = f"{config.host}:{config.port}"
    listen(server, address, credentials)
    stop_metrics = None
    if config.metrics_port is not None:
        stop_metrics = serve_metrics(metrics.registry, config.host, config.metrics_port)
    await server.start()
    log.info(
        "scheduler listening",
        address=address,
        executors=list(config.executors),
        tls="mtls" if tls and tls.ca_certs else bool(tls),
        executor_tls=security.tls is not None,
        client_rate_limit=config.client_rate_limit,
        metrics_port=config.metrics_port,
    )
    engine_task = asyncio.create_task(engine.run())
    watcher = asyncio.create_task(monitor.watch(engine, health))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([engine_task, stopped], return_when=asyncio.FIRST_COMPLETED)
    try:
        if stop.is_set():
            await drain(generation, health, config.shutdown_grace)
    finally:
        watcher.cancel()
        stopped.cancel()
        engine_task.cancel()  # streams still running end with UNAVAILABLE
        await asyncio.wait([engine_task])
        await engine.release_executors()
        await server.stop(grace=2.0)
        if stop_metrics is not None:
            stop_metrics()
        if request_log is not None:
            request_log.close()
        log.info("scheduler stopped")
    if not engine_task.cancelled() and engine_task.exception():
        raise engine_task.exception()


async def drain(generation: GenerationService, health: monitor.SchedulerHealth, grace: float) -> None:
    """Graceful shutdown: health NOT_SERVING and new streams refused at once, then up to `grace`
    seconds for the running streams to finish."""
    generation.draining = True
    await health.drain()
    log.info("scheduler draining", streams=generation.num_streams, grace_s=grace)
    if await generation.wait_for_streams(grace):
        log.info("drained: every stream finished")
    else:
        log.warning(
            "shutdown grace over: streams still running end with UNAVAILABLE", streams=generation.num_streams
        )


def serve(config: ServiceConfig) -> None:
    asyncio.run(serve_async(config))
