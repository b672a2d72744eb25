"""The workload in one process, without gRPC: what the scheduler/executor split costs (issue 5).

The scheduler's own `Engine` drives the executor's own `ModelRunner` through `InProcessTransport`
(pagedserve.entrypoints.inprocess, the path the offline `LLM` API runs on) on one asyncio loop, and
the bench submits each request straight to the engine with the sampling and stop settings the
public API would derive from the same GenerateRequest. So the only thing missing compared with
`--launch` is the two gRPC hops (client -> scheduler -> executor) and their processes: the measured
difference is the price of the split.

    pagedserve bench --in-process --model DIR --workload W1
    pagedserve bench --launch --model DIR --workload W1 --compare-in-process
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shlex
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from pagedserve.bench.client import (
    PassResult,
    RequestRecord,
    SendOptions,
    build_request,
    measure_pass,
    warmup_requests,
)
from pagedserve.bench.workloads import BenchRequest, Workload, plan_passes
from pagedserve.common.logs import configure_logging
from pagedserve.common.validation import InvalidRequest, validate_request, values_from_proto
from pagedserve.entrypoints.inprocess import InProcessTransport
from pagedserve.executor.config import ExecutorConfig, add_cli_args
from pagedserve.executor.runner import ModelRunner
from pagedserve.protos import admin_pb2, generation_pb2
from pagedserve.scheduler.admission import sampling_options, stop_conditions
from pagedserve.scheduler.engine import Engine, EngineFull, EngineUnavailable
from pagedserve.scheduler.service import AdminService, load_tokenizer, next_delta
from pagedserve.scheduler.service_config import ServiceConfig

T = TypeVar("T")

# The status a gRPC client would get for each way the public API refuses or fails a request.
_STATUS = {
    InvalidRequest: "INVALID_ARGUMENT",
    EngineUnavailable: "UNAVAILABLE",
    EngineFull: "RESOURCE_EXHAUSTED",
    TimeoutError: "DEADLINE_EXCEEDED",
}


async def _send_direct(engine: Engine, req: BenchRequest, options: SendOptions, tag: str) -> RequestRecord:
    """What `client._send` does over gRPC, minus gRPC: the same GenerateRequest goes through the
    public API's own helpers into `engine.submit`, and the request's deltas are merged as the
    service merges them for a client that fell behind, one message per read."""
    record = RequestRecord(req.index, len(req.prompt), req.output_len)
    request = build_request(req, options, tag)
    record.start = time.perf_counter()
    active = None
    try:
        async with asyncio.timeout(options.timeout):
            info = engine.model_info()
            if info is None:
                raise EngineUnavailable("no executor has attached yet")
            params = validate_request(values_from_proto(request))
            prompt = list(request.token_ids.ids)
            grammar = None
            if params.structured_outputs is not None:  # as the service: compiled once, awaited here
                grammar = await engine.compile_grammar(params.structured_outputs)
            active = engine.submit(
                request.request_id,
                prompt,
                sampling_options(params),
                stop_conditions(params, len(prompt), info),
                priority=params.priority,
                grammar=grammar,
            )
            while True:
                item = await next_delta(active.deltas)
                if item.token_ids:
                    record.message_times.append(time.perf_counter())
                    record.message_tokens.append(len(item.token_ids))
                    record.token_ids.extend(item.token_ids)
                if item.finish_reason is not None:
                    record.finish_reason = generation_pb2.FinishReason.Name(int(item.finish_reason))
                    record.cached_prompt_tokens = active.request.num_cached_prompt_tokens
                    break
    except (InvalidRequest, EngineUnavailable, EngineFull, TimeoutError) as exc:
        record.error = f"{_STATUS[type(exc)]}: {exc}"
    finally:
        if active is not None:
            engine.abort(active)  # no-op once finished, as in the service
    record.end = time.perf_counter()
    return record


async def _unless_engine_dies(engine_task: asyncio.Task, work: Awaitable[T]) -> T:
    """Awaits `work`, but raises the engine's error if its task ends first (requests would hang)."""
    work_task = asyncio.ensure_future(work)
    await asyncio.wait([engine_task, work_task], return_when=asyncio.FIRST_COMPLETED)
    if not work_task.done():
        work_task.cancel()
        engine_task.result()
        raise RuntimeError("the engine stopped")
    return work_task.result()


async def _measure(
    runner: ModelRunner,
    executor: ExecutorConfig,
    service: ServiceConfig,
    workload: Workload,
    rates: Sequence[float],
    options: SendOptions,
    num_warmups: int,
    tag: str,
) -> tuple[list[BenchRequest], list[PassResult]]:
    transport = InProcessTransport(runner, executor.model)
    engine = Engine(service, load_tokenizer(service.model), lambda _address: transport)
    admin = AdminService(engine)

    async def get_stats() -> admin_pb2.SchedulerStats:
        return await admin.GetStats(None, None)

    def run(requests: Sequence[BenchRequest], rate: float, label: str) -> Awaitable[PassResult]:
        send = lambda req: _send_direct(engine, req, options, label)  # noqa: E731
        return _unless_engine_dies(engine_task, measure_pass(send, get_stats, requests, rate, options, label))

    engine_task = asyncio.create_task(engine.run())
    try:
        info = await _unless_engine_dies(engine_task, engine.wait_until_attached())
        if num_warmups:
            await run(warmup_requests(num_warmups, info.vocab_size, info.max_model_len), math.inf, "warmup")
        planned = plan_passes(workload, list(rates), info.vocab_size, info.max_model_len, tag)
        passes = []
        for p in planned:
            passes.append(await run(p.requests, p.request_rate, p.label))
            passes[-1].seed = p.seed
        return planned[0].requests, passes
    finally:
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await engine_task


def executor_config(
    model: str, executor_args: str, prog: str = "pagedserve bench --executor-args"
) -> ExecutorConfig:
    """--executor-args, read by the executor's own parser (so both passes get the same flags); a bad
    one ends the program as argparse does, under `prog`."""
    parser = add_cli_args(argparse.ArgumentParser(prog=prog))
    ns = parser.parse_args(["--model", model, *shlex.split(executor_args)])
    return ExecutorConfig.from_args(ns, parser=parser)


def service_config(
    model: str, scheduler_args: str, prog: str = "pagedserve bench --scheduler-args"
) -> ServiceConfig:
    """--scheduler-args, read by the scheduler's own parser."""
    parser = argparse.ArgumentParser(prog=prog)
    ServiceConfig.add_cli_args(parser)
    ns = parser.parse_args(["--model", model, *shlex.split(scheduler_args)])
    return ServiceConfig.from_args(ns, parser=parser)


def run_in_process(
    executor: ExecutorConfig,
    service: ServiceConfig,
    workload: Workload,
    rates: Sequence[float],
    options: SendOptions,
    num_warmups: int = 0,
    tag: str = "in-process",
) -> tuple[list[BenchRequest], list[PassResult]]:
    """Loads the model here, then runs the warmup and one pass per rate exactly as `--launch`
    would (same prompts, seeds and labels); returns the first pass's requests and the passes."""
    configure_logging("bench-in-process")  # to stderr, like the launched services' logs
    runner = ModelRunner.create(executor)
    return asyncio.run(_measure(runner, executor, service, workload, rates, options, num_warmups, tag))
