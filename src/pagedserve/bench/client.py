"""One measured pass: streams every request through the public gRPC API from one asyncio loop
and records its timings, with the scheduler's counters read before and after."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pagedserve.bench.workloads import BenchRequest, LengthRange, Workload, arrival_times, generate_requests
from pagedserve.client import make_request
from pagedserve.protos import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc


@dataclass
class RequestRecord:
    """What the client saw of one request; times are perf_counter seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    start: float = 0.0
    end: float = 0.0
    message_times: list[float] = field(default_factory=list)  # one per message carrying tokens
    message_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    cpu_cached_prompt_tokens: int = 0  # of those, loaded from the CPU tier
    finish_reason: str = ""
    error: str = ""  # gRPC status name (and details) when the request failed

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def num_output(self) -> int:
        return len(self.token_ids)

    @property
    def ttft(self) -> float | None:
        return self.message_times[0] - self.start if self.message_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.num_output < 2:
            return None
        return (self.e2e - ttft) / (self.num_output - 1)

    def itls(self) -> list[float]:
        """Per-token gaps: a message with k tokens after a gap g contributes k values of g / k."""
        out: list[float] = []
        for i in range(1, len(self.message_times)):
            k = self.message_tokens[i]
            out += [(self.message_times[i] - self.message_times[i - 1]) / k] * k
        return out


@dataclass
class PassResult:
    label: str
    request_rate: float
    records: list[RequestRecord]
    start: float
    end: float
    stats_before: admin_pb2.SchedulerStats | None
    stats_after: admin_pb2.SchedulerStats | None
    sampled_peak_blocks: int = 0
    sampled_slot_utilization: float = 0.0  # slot utilization when the sampled block count peaked
    sampled_peak_running: int = 0  # the most requests running at once (all executors), as sampled
    prefix_caching: bool | None = None
    seed: int | None = None  # the prompts' seed
    client_cpu_s: float | None = None  # CPU seconds the client spent sending, where measured
    gateway_cpu_s: float | None = None  # CPU seconds of the launched OpenAI gateway(s) over the pass
    max_concurrency: int | None = None  # the pass's --max-concurrency (None: no limit)
    floor_inputs: ReadFloorInputs | None = None  # what the executors reported (Admin.ListExecutors)


@dataclass(frozen=True)
class ReadFloorInputs:
    """What the per-step read floor needs from the executors (admin.proto's ExecutorStatus, as
    each executor reported it on attach): the weight bytes a decode step reads, the KV bytes of one
    context token, a device-to-device copy's bytes/s (read + write; 0 off CUDA), and how many
    executors share the requests (each reads its own weights)."""

    weight_read_bytes: int
    kv_bytes_per_token: int
    copy_bytes_per_s: float
    num_executors: int = 1


def read_floor_inputs(address: str, timeout: float = 10.0) -> ReadFloorInputs | None:
    """The first attached executor's floor inputs behind the scheduler at `address` (None when none
    is attached or the scheduler predates the fields)."""
    with grpc.insecure_channel(address) as channel:
        try:
            listed = admin_pb2_grpc.AdminStub(channel).ListExecutors(
                admin_pb2.ListExecutorsRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return None
    attached = [e for e in listed.executors if e.attached and e.weight_read_bytes]
    if not attached:
        return None
    first = attached[0]
    return ReadFloorInputs(
        first.weight_read_bytes, first.kv_bytes_per_token, first.copy_bytes_per_s, len(attached)
    )


@dataclass(frozen=True)
class SendOptions:
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 1
    max_concurrency: int | None = None
    timeout: float | None = None


def build_request(req: BenchRequest, options: SendOptions, tag: str) -> generation_pb2.GenerateRequest:
    return make_request(
        list(req.prompt),
        max_tokens=req.output_len,
        temperature=options.temperature,
        seed=options.seed * 1_000_003 + req.index if options.temperature > 0 else None,
        ignore_eos=options.ignore_eos,
        request_id=f"bench-{re.sub(r'[^A-Za-z0-9.]+', '-', tag)}-{req.index}",
        structured_outputs=req.structured_outputs,
    )


Send = Callable[[BenchRequest], Awaitable[RequestRecord]]
GetStats = Callable[[], Awaitable[admin_pb2.SchedulerStats | None]]


async def _send(
    stub: generation_pb2_grpc.GenerationStub, req: BenchRequest, options: SendOptions, tag: str
) -> RequestRecord:
    """Streams one request through the public API and records what the client saw."""
    record = RequestRecord(req.index, len(req.prompt), req.output_len)
    request = build_request(req, options, tag)
    record.start = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=options.timeout):
            if response.token_ids:
                record.message_times.append(time.perf_counter())
                record.message_tokens.append(len(response.token_ids))
                record.token_ids.extend(response.token_ids)
            if response.finish_reason:
                record.finish_reason = generation_pb2.FinishReason.Name(response.finish_reason)
                record.cached_prompt_tokens = response.usage.cached_prompt_tokens
                record.cpu_cached_prompt_tokens = response.usage.cpu_cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    record.end = time.perf_counter()
    return record


@dataclass
class PassPeaks:
    """This pass's peaks, from the GetStats samples taken while it runs (the server's own peak KV
    use is over its lifetime, and it keeps no peak of running requests)."""

    blocks: int = 0
    slot_utilization: float = 0.0  # when the block count peaked
    running: int = 0

    def update(self, stats: admin_pb2.SchedulerStats | None) -> None:
        if stats is None:
            return
        if stats.gpu_blocks_in_use > self.blocks:
            self.blocks, self.slot_utilization = stats.gpu_blocks_in_use, stats.slot_utilization
        self.running = max(self.running, stats.num_running)

    def result(self, label, request_rate, records, start, end, before, after) -> PassResult:
        return PassResult(
            label, request_rate, records, start, end, before, after,
            self.blocks, self.slot_utilization, sampled_peak_running=self.running,
        )  # fmt: skip


async def _get_stats(channel) -> admin_pb2.SchedulerStats | None:
    try:
        return await admin_pb2_grpc.AdminStub(channel).GetStats(
            admin_pb2.GetSchedulerStatsRequest(), timeout=10
        )
    except grpc.aio.AioRpcError:
        return None


async def measure_pass(
    send: Send,
    get_stats: GetStats,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    arrivals: Sequence[float] | None = None,
) -> PassResult:
    """One pass, whatever carries the requests: each is sent at its arrival time (once
    --max-concurrency admits it) by `send`, and the scheduler's counters are read through
    `get_stats` before, during (this pass's peak KV use) and after. A multi-turn request (turn >
    0) is sent `think_time` after its conversation's previous turn ended, with the conversation so
    far (every earlier prompt and answer) before its own tokens; turn 0 goes at its arrival time.

    Args:
        arrivals: each request's send offset in seconds (a replayed log's); default: drawn for
            `request_rate` (`arrival_times`).
    """
    from tqdm import tqdm

    if arrivals is None:
        arrivals = arrival_times(len(requests), request_rate, options.seed)
    before = await get_stats()
    sem = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    peaks = PassPeaks()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    # (conversation, turn) -> the turn's whole prompt and what came back, for the next turn.
    turns: dict[tuple[int, int], asyncio.Future] = {
        (r.conversation, r.turn): loop.create_future() for r in requests if r.conversation is not None
    }

    async def sample_stats() -> None:
        while not done.is_set():
            peaks.update(await get_stats())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.25)

    async def send_at(req: BenchRequest, at: float, bar) -> RequestRecord:
        if req.turn > 0:
            history, answer = await turns[req.conversation, req.turn - 1]
            await asyncio.sleep(req.think_time)
            req = dataclasses.replace(req, prompt=history + tuple(answer.token_ids) + req.prompt)
        else:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
        async with sem if sem is not None else contextlib.nullcontext():
            record = await send(req)
        if req.conversation is not None:
            turns[req.conversation, req.turn].set_result((req.prompt, record))
        bar.update(1)
        return record

    sampler = asyncio.create_task(sample_stats()) if before is not None else None
    with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr) as bar:
        start = time.perf_counter()
        records = await asyncio.gather(
            *(send_at(req, start + arrivals[i], bar) for i, req in enumerate(requests))
        )
        end = time.perf_counter()
    done.set()
    if sampler is not None:
        await sampler
    after = await get_stats()
    return peaks.result(label, request_rate, list(records), start, end, before, after)


async def _run_pass(
    address: str,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    arrivals: Sequence[float] | None = None,
) -> PassResult:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await measure_pass(
            lambda req: _send(stub, req, options, label),
            lambda: _get_stats(channel),
            requests,
            request_rate,
            options,
            label,
            arrivals,
        )


def run_pass(
    address: str,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str = "bench",
    arrivals: Sequence[float] | None = None,
) -> PassResult:
    """Sends `requests` (arriving at `request_rate`, or at the offsets `arrivals`) and waits for all
    of them."""
    return asyncio.run(_run_pass(address, requests, request_rate, options, label, arrivals))


def get_model_info(address: str, timeout: float = 10.0) -> generation_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)


def warmup_requests(num: int, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """Short unrelated prompts (their own RNG) that compile kernels before the measured pass."""
    workload = Workload("random", max(num, 1), LengthRange(16, 64), LengthRange(8, 8), seed=-1)
    return generate_requests(workload, vocab_size, max_model_len)[:num]
