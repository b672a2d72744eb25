"""`pagedserve bench`: a load generator for a running server, in the spirit of `vllm bench serve`.

It streams token-id prompts through the public gRPC API from its own process (one asyncio event
loop, one channel, many concurrent streams), measures latency per request on the client and
reads the scheduler's counters (Admin.GetStats) before and after each pass. The presets W1, W2
and W3 generate /work/shared/bench/WORKLOADS.md's workloads exactly.

    pagedserve bench --workload W1 --port 50051
    pagedserve bench --launch --model DIR --workload W2 --compare-prefix-caching
    pagedserve bench --launch --model DIR --workload W3 --request-rates 2,8,32
    pagedserve bench --launch --model DIR --workload W1 --baseline hf-static --baseline-num-prompts 128

Layout of this file: workloads -> one pass over gRPC -> metrics -> launched services ->
Hugging Face baselines -> report (table, JSON, plot) -> command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from pagedserve.client import make_request
from protos import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class LengthRange:
    """A token count: fixed (lo == hi) or uniform over [lo, hi] inclusive."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"bad length range {self.lo}:{self.hi}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        lo, _, hi = text.partition(":")
        return cls(int(lo), int(hi or lo))

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class Workload:
    """What to send; `input_len` is the unique suffix when `prefix_len` > 0 (shared-prefix)."""

    dataset: str  # "random" or "shared-prefix"
    num_prompts: int
    input_len: LengthRange
    output_len: LengthRange
    prefix_len: int = 0
    seed: int = 1

    def __post_init__(self) -> None:
        if self.dataset not in ("random", "shared-prefix"):
            raise ValueError(f"unknown dataset {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be positive")
        if self.output_len.lo < 1:
            raise ValueError("output lengths must be at least 1")


# WORKLOADS.md; W3 is W1's lengths with Poisson arrivals (the rate comes from the command line).
PRESETS: dict[str, dict] = {
    "W1": dict(
        dataset="random", num_prompts=512, input_len="128:1024", output_len="64:512", request_rate="inf"
    ),
    "W2": dict(
        dataset="shared-prefix",
        num_prompts=256,
        prefix_len=1024,
        input_len="64",
        output_len="64",
        request_rate="inf",
    ),
    "W3": dict(dataset="random", num_prompts=512, input_len="128:1024", output_len="64:512"),
}
DEFAULTS = dict(
    dataset="random", num_prompts=100, input_len="128", output_len="128", prefix_len=0, request_rate="inf"
)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: tuple[int, ...]
    output_len: int


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """WORKLOADS.md's [1000, 100000), clamped so a small test vocabulary still works."""
    if vocab_size >= 100_000:
        return 1000, 100_000
    return min(1000, vocab_size // 2), vocab_size


def generate_requests(
    workload: Workload, vocab_size: int, max_model_len: int | None = None
) -> list[BenchRequest]:
    """Draws every request from `random.Random(seed)`: for each, the prompt (its length, then its
    ids), then the output length; the shared prefix, if any, is drawn first. Lengths are capped to
    `max_model_len` afterwards, so the draws do not depend on the server."""
    rng = random.Random(workload.seed)
    lo, hi = token_id_range(vocab_size)
    prefix = [rng.randrange(lo, hi) for _ in range(workload.prefix_len)]
    requests = []
    for index in range(workload.num_prompts):
        n = workload.input_len.sample(rng)
        prompt = prefix + [rng.randrange(lo, hi) for _ in range(n)]
        output_len = workload.output_len.sample(rng)
        if max_model_len is not None:
            prompt = prompt[: max_model_len - 1]
            output_len = max(1, min(output_len, max_model_len - len(prompt)))
        requests.append(BenchRequest(index, tuple(prompt), output_len))
    return requests


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: all 0 for rate inf, else a Poisson process (the first at 0).

    The gaps come from their own seeded RNG, so W3 sends exactly W1's prompts."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(f"{seed}:arrivals")
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


# ---------------------------------------------------------------------------------------------
# One pass over the public API


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
    prefix_caching: bool | None = None
    seed: int | None = None  # the prompts' seed


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
    )


async def _send(
    stub, req: BenchRequest, options: SendOptions, tag: str, send_at: float, sem, on_done
) -> RequestRecord:
    """Sends one request at perf_counter time `send_at` (once `sem` admits it) and records its stream."""
    record = RequestRecord(req.index, len(req.prompt), req.output_len)
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    async with sem if sem is not None else contextlib.nullcontext():
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
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        record.end = time.perf_counter()
    on_done()
    return record


async def _get_stats(channel) -> admin_pb2.SchedulerStats | None:
    try:
        return await admin_pb2_grpc.AdminStub(channel).GetStats(
            admin_pb2.GetSchedulerStatsRequest(), timeout=10
        )
    except grpc.aio.AioRpcError:
        return None


async def _run_pass(
    address: str,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
) -> PassResult:
    arrivals = arrival_times(len(requests), request_rate, options.seed)
    from tqdm import tqdm

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        before = await _get_stats(channel)
        sem = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        peak = [0, 0.0]
        done = asyncio.Event()

        async def sample_stats() -> None:  # the server's peak is lifetime; this one is this pass's
            while not done.is_set():
                stats = await _get_stats(channel)
                if stats is not None and stats.gpu_blocks_in_use > peak[0]:
                    peak[:] = [stats.gpu_blocks_in_use, stats.slot_utilization]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.25)

        sampler = asyncio.create_task(sample_stats()) if before is not None else None
        with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr) as bar:
            start = time.perf_counter()
            tasks = [
                _send(stub, req, options, label, start + arrivals[i], sem, lambda: bar.update(1))
                for i, req in enumerate(requests)
            ]
            records = await asyncio.gather(*tasks)
            end = time.perf_counter()
        done.set()
        if sampler is not None:
            await sampler
        after = await _get_stats(channel)
    return PassResult(label, request_rate, list(records), start, end, before, after, peak[0], peak[1])


def run_pass(
    address: str,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str = "bench",
) -> PassResult:
    """Sends `requests` (arriving at `request_rate`) and waits for all of them."""
    return asyncio.run(_run_pass(address, requests, request_rate, options, label))


def get_model_info(address: str, timeout: float = 10.0) -> generation_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)


def warmup_requests(num: int, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """Short unrelated prompts (their own RNG) that compile kernels before the measured pass."""
    workload = Workload("random", max(num, 1), LengthRange(16, 64), LengthRange(8, 8), seed=-1)
    return generate_requests(workload, vocab_size, max_model_len)[:num]


# ---------------------------------------------------------------------------------------------
# Metrics


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (None when there are no values)."""
    import numpy as np

    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def throughput_timeline(records: Sequence[RequestRecord], start: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` bins from the start of the pass."""
    bins: Counter[int] = Counter()
    last = 0
    for r in records:
        for t, k in zip(r.message_times, r.message_tokens, strict=True):
            b = int((t - start) // bin_s)
            bins[b] += k
            last = max(last, b)
    return [bins[b] / bin_s for b in range(last + 1)] if bins else []


def server_metrics(result: PassResult) -> dict | None:
    """Deltas of the scheduler's counters over the pass, and its peak KV use."""
    before, after = result.stats_before, result.stats_after
    if before is None or after is None:
        return None
    if after.peak_gpu_blocks_in_use > before.peak_gpu_blocks_in_use:  # the lifetime peak moved: it is ours
        peak, slot_util, source = after.peak_gpu_blocks_in_use, after.peak_slot_utilization, "server"
    else:
        peak, slot_util, source = result.sampled_peak_blocks, result.sampled_slot_utilization, "sampled"
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    queries = after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
    return {
        "preemptions": after.num_preemptions - before.num_preemptions,
        "num_gpu_blocks": after.num_gpu_blocks,
        "peak_gpu_blocks_in_use": peak,
        "peak_slot_utilization": slot_util,
        "peak_source": source,
        "prompt_tokens_computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_query_tokens": queries,
        "prefix_cache_hit_rate": hits / queries if queries else None,  # None: queries not reported
        "steps": after.steps - before.steps,
        "tokens_generated": after.tokens_generated - before.tokens_generated,
    }


def summarize(result: PassResult) -> dict:
    """Every metric of a pass, JSON-ready, with per-request records."""
    records = result.records
    ok = [r for r in records if r.ok]
    duration = max(result.end - result.start, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.num_output for r in ok)
    cached_tokens = sum(r.cached_prompt_tokens for r in ok)
    errors = Counter(r.error.split(":", 1)[0] for r in records if not r.ok)
    return {
        "label": result.label,
        "request_rate": "inf" if math.isinf(result.request_rate) else result.request_rate,
        "prefix_caching": result.prefix_caching,
        "seed": result.seed,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(errors),
        "error_examples": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": cached_tokens,  # Usage.cached_prompt_tokens, summed
        "cached_prompt_fraction": cached_tokens / input_tokens if input_tokens else 0.0,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([x for r in ok for x in r.itls()]),
        "e2e_ms": distribution([r.e2e for r in ok]),
        "server": server_metrics(result),
        "throughput_timeline": throughput_timeline(records, result.start),
        "requests": [
            {
                "index": r.index,
                "prompt_len": r.prompt_len,
                "max_tokens": r.max_tokens,
                "output_tokens": r.num_output,
                "cached_prompt_tokens": r.cached_prompt_tokens,
                "start_s": r.start - result.start,
                "ttft_ms": None if r.ttft is None else r.ttft * 1000,
                "e2e_ms": r.e2e * 1000,
                "finish_reason": r.finish_reason,
                "error": r.error or None,
            }
            for r in records
        ],
    }


def compare_outputs(a: PassResult, b: PassResult) -> dict:
    """Whether two passes over the same requests produced the same tokens (greedy: they must)."""
    tokens_b = {r.index: r.token_ids for r in b.records if r.ok}
    both = [r for r in a.records if r.ok and r.index in tokens_b]
    differing = [r.index for r in both if r.token_ids != tokens_b[r.index]]
    return {"compared": len(both), "identical": not differing and bool(both), "differing": differing[:20]}


# ---------------------------------------------------------------------------------------------
# Launched services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(
    model: str,
    log_dir: Path,
    executor_args: Sequence[str] = (),
    scheduler_args: Sequence[str] = (),
    timeout: float = 900.0,
) -> Iterator[str]:
    """Runs executor + scheduler as processes on loopback; yields the scheduler's address once
    GetModelInfo answers, and stops both (scheduler first) on exit."""
    port, executor_port = free_port(), free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    commands = {
        "executor": [sys.executable, "-m", "executor", "--model", model, "--host", "127.0.0.1",
                     "--port", str(executor_port), *executor_args],
        "scheduler": [sys.executable, "-m", "scheduler", "--model", model, "--host", "127.0.0.1",
                      "--port", str(port), "--executor", f"127.0.0.1:{executor_port}", *scheduler_args],
    }  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    address = f"127.0.0.1:{port}"
    try:
        for name, cmd in commands.items():
            with open(log_dir / f"{name}.log", "w") as log:
                procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        print(f"bench: launched executor + scheduler on {address} (logs in {log_dir})", file=sys.stderr)
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    tail = (log_dir / f"{name}.log").read_text(errors="replace")[-4000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")
            try:
                get_model_info(address, timeout=2)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"services not ready after {timeout:.0f} s; see {log_dir}") from None
                time.sleep(0.5)
        yield address
    finally:
        for proc in reversed(procs.values()):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(procs.values()):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------------------------
# Hugging Face baselines


def _load_hf_model(model_dir: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as in the pagedserve pass
    return model, device


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_static(
    model_dir: str, requests: Sequence[BenchRequest], batch_size: int = 64, device: str = "auto"
):
    """`model.generate` on static, left-padded batches, greedy, each run to its longest output.
    Only each request's own output tokens count as useful; the rest is padding waste."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig

    model, device = _load_hf_model(model_dir, device)
    pad = 0
    useful = generated = input_tokens = 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    _sync(device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf-static", unit="batch", file=sys.stderr, leave=False):
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        max_new = max(r.output_len for r in batch)
        config = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
        steps = out.shape[1] - width
        generated += steps * len(batch)
        useful += sum(min(r.output_len, steps) for r in batch)
        input_tokens += sum(len(r.prompt) for r in batch)
    _sync(device)
    duration = time.perf_counter() - start
    return _baseline_summary("hf-static", len(requests), duration, input_tokens, useful, generated, device)


def run_hf_cb(model_dir: str, requests: Sequence[BenchRequest], device: str = "auto", cb_config=None):
    """transformers' continuous batching (the paged-cache manager `generate_batch` drives), with
    each request's own max_new_tokens and EOS disabled. `cb_config` (a ContinuousBatchingConfig)
    defaults to transformers' defaults, the setting of WORKLOADS.md's anchor."""
    import inspect

    from tqdm import tqdm
    from transformers import GenerationConfig

    model, device = _load_hf_model(model_dir, device)
    max_new = max(r.output_len for r in requests)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    kwargs = dict(generation_config=config, block=True, timeout=5, continuous_batching_config=cb_config)
    if "workload_hints" in inspect.signature(model.continuous_batching_context_manager).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(r.prompt) for r in requests),
            max_generated_length=max_new,
            num_requests=len(requests),
        )
    results = {}
    with model.continuous_batching_context_manager(**kwargs) as manager:
        _sync(device)
        start = time.perf_counter()
        for r in requests:
            manager.add_request(
                list(r.prompt), request_id=f"r{r.index}", max_new_tokens=r.output_len, eos_token_id=-1
            )
        with tqdm(total=len(requests), desc="hf-cb", unit="req", file=sys.stderr, leave=False) as bar:
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
                elif result is None and not manager.is_running():
                    break
        _sync(device)
        duration = time.perf_counter() - start
    useful = sum(len(r.generated_tokens) for r in results.values() if r.error is None)
    input_tokens = sum(len(r.prompt) for r in requests)
    summary = _baseline_summary("hf-cb", len(requests), duration, input_tokens, useful, useful, device)
    summary["failed"] = len(requests) - sum(1 for r in results.values() if r.error is None)
    return summary


def _baseline_summary(name, num, duration, input_tokens, useful, generated, device) -> dict:
    return {
        "system": name,
        "device": device,
        "num_requests": num,
        "failed": 0,
        "duration_s": duration,
        "output_tokens": useful,
        "generated_tokens": generated,
        "padding_waste": 1 - useful / generated if generated else 0.0,
        "output_throughput": useful / duration,
        "total_token_throughput": (input_tokens + useful) / duration,
    }


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.1%}"


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([f"== {title} ==", line(header), rule, *(line(r) for r in rows)])


def results_table(runs: Sequence[dict], comparison: dict | None = None) -> str:
    """One column per pass; latency rows are mean / p50 / p90 / p99 in ms."""
    rows: list[list[str]] = []

    def add(name: str, values: Sequence) -> None:
        rows.append([name, *(_fmt(v) for v in values)])

    add("request rate (req/s)", [r["request_rate"] for r in runs])
    add("requests ok / failed", [f"{r['completed']} / {r['failed']}" for r in runs])
    add("duration (s)", [r["duration_s"] for r in runs])
    add("request throughput (req/s)", [r["request_throughput"] for r in runs])
    add("output throughput (tok/s)", [r["output_throughput"] for r in runs])
    add("total token throughput (tok/s)", [r["total_token_throughput"] for r in runs])
    add(
        "input / output tokens", [f"{r['total_input_tokens']:,} / {r['total_output_tokens']:,}" for r in runs]
    )
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for stat in ("mean", "p50", "p90", "p99"):
            add(f"{name} {stat} (ms)", [r[key][stat] for r in runs])
    servers = [r["server"] or {} for r in runs]
    add("preemptions", [s.get("preemptions") for s in servers])
    add(
        "peak KV blocks in use / total",
        [f"{s['peak_gpu_blocks_in_use']:,} / {s['num_gpu_blocks']:,}" if s else None for s in servers],
    )
    add("peak slot utilization", [_pct(s.get("peak_slot_utilization")) for s in servers])
    add("prompt tokens computed", [s.get("prompt_tokens_computed") for s in servers])
    add("prefix cache hit rate (hit/query)", [_pct(s.get("prefix_cache_hit_rate")) for s in servers])
    add("cached prompt tokens (usage)", [f"{r['cached_prompt_fraction']:.1%}" for r in runs])
    text = render_table("pagedserve bench", ["metric", *(r["label"] for r in runs)], rows)
    for r in runs:
        for example in r["error_examples"]:
            text += f"\nfailed ({r['label']}): {example[:200]}"
    if comparison:
        text += "\n\n" + render_table(
            "prefix caching on vs off",
            ["metric", "value"],
            [[k, _fmt(v, 3)] for k, v in comparison.items()],
        )
    return text


def baseline_table(reference: dict, baselines: Sequence[dict], total_requests: int) -> str:
    header = ["system", "requests", "output tok/s", "total tok/s", "duration (s)", "padding waste", "ratio"]
    rows = [
        [
            "pagedserve",
            f"all {reference['num_requests']}",
            _fmt(reference["output_throughput"]),
            _fmt(reference["total_token_throughput"]),
            _fmt(reference["duration_s"]),
            "0.0%",
            "",
        ]
    ]
    for b in baselines:
        ratio = reference["output_throughput"] / b["output_throughput"] if b["output_throughput"] else None
        subset = "all" if b["num_requests"] == total_requests else "first"
        rows.append(
            [
                f"{b['system']} ({b['device']})",
                f"{subset} {b['num_requests']}",
                _fmt(b["output_throughput"]),
                _fmt(b["total_token_throughput"]),
                _fmt(b["duration_s"]),
                f"{b['padding_waste']:.1%}",
                f"{_fmt(ratio)}x" if ratio else "n/a",
            ]
        )
    note = "ratio = pagedserve output tok/s / baseline output tok/s (useful tokens only)"
    return render_table("baselines", header, rows) + "\n" + note


def write_plot(path: Path, runs: Sequence[dict], passes: Sequence[PassResult]) -> None:
    """Histograms of TTFT, ITL and E2E, and output tokens/s per 1 s bin, one colour per pass."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (
        (
            axes[0, 0],
            "TTFT (ms)",
            lambda p: [r.ttft * 1000 for r in p.records if r.ok and r.ttft is not None],
        ),
        (axes[0, 1], "ITL (ms)", lambda p: [x * 1000 for r in p.records if r.ok for x in r.itls()]),
        (axes[1, 0], "E2E latency (ms)", lambda p: [r.e2e * 1000 for r in p.records if r.ok]),
    )
    for ax, title, values in panels:
        data = [values(p) for p in passes]
        if not any(data):
            continue
        edges = np.histogram_bin_edges(np.concatenate([d for d in data if d]), bins=40)  # shared bins
        for run, d in zip(runs, data, strict=True):
            if d:
                ax.hist(d, bins=edges, alpha=0.5, label=run["label"])
        ax.set_title(title)
        ax.set_ylabel("count")
    ax = axes[1, 1]
    for run in runs:
        timeline = run["throughput_timeline"]
        if timeline:
            ax.stairs(timeline, np.arange(len(timeline) + 1), label=run["label"])
    ax.set_title("output throughput over time")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s (1 s bins)")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve bench", description="benchmark a pagedserve server over gRPC"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--workload", choices=tuple(PRESETS), help="WORKLOADS.md preset; explicit flags override it"
    )
    p.add_argument("--dataset", choices=("random", "shared-prefix"))
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", help="prompt tokens (suffix for shared-prefix): N or MIN:MAX")
    p.add_argument("--output-len", help="output tokens: N or MIN:MAX")
    p.add_argument("--prefix-len", type=int, help="shared-prefix: tokens of the common prefix")
    p.add_argument("--request-rate", help="'inf' (all at t=0) or a Poisson rate in req/s")
    p.add_argument("--request-rates", help="comma-separated rates: one pass per rate, tabled together")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--num-warmups", type=int, default=0, help="short unrelated requests sent before measuring"
    )
    p.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    p.add_argument("--result-file", type=Path, default=Path("bench-results/bench.json"))
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: the result file with .png)")
    p.add_argument("--no-plot", action="store_true")
    launch = p.add_argument_group("launched services")
    launch.add_argument("--launch", action="store_true", help="start executor + scheduler on loopback")
    launch.add_argument("--model", help="model directory (--launch and baselines)")
    launch.add_argument("--executor-args", default="", help="extra executor flags (one shell-quoted string)")
    launch.add_argument(
        "--scheduler-args", default="", help="extra scheduler flags (one shell-quoted string)"
    )
    launch.add_argument("--launch-timeout", type=float, default=900.0)
    launch.add_argument("--log-dir", type=Path, default=None, help="default: next to the result file")
    launch.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="with --launch: run with prefix caching on, then off",
    )
    base = p.add_argument_group("Hugging Face baselines (run after the pagedserve pass)")
    base.add_argument("--baseline", action="append", choices=("hf-static", "hf-cb"), default=[])
    base.add_argument(
        "--baseline-num-prompts", type=int, default=None, help="the first N requests (default all)"
    )
    base.add_argument("--baseline-batch-size", type=int, default=64, help="hf-static batch size")
    base.add_argument("--baseline-device", default="auto", help="auto, cpu or cuda[:N]")
    return p


def resolve(args: argparse.Namespace) -> tuple[Workload, list[float]]:
    """The workload and request rates: explicit flags, then the preset, then the defaults."""
    preset = PRESETS.get(args.workload or "", {})

    def pick(name: str):
        value = getattr(args, name)
        return value if value is not None else preset.get(name, DEFAULTS.get(name))

    dataset = pick("dataset")
    prefix_len = pick("prefix_len") if dataset == "shared-prefix" else 0
    if dataset == "shared-prefix" and args.prefix_len is None and "prefix_len" not in preset:
        prefix_len = 256
    workload = Workload(
        dataset=dataset,
        num_prompts=pick("num_prompts"),
        input_len=LengthRange.parse(pick("input_len")),
        output_len=LengthRange.parse(pick("output_len")),
        prefix_len=prefix_len,
        seed=args.seed,
    )
    if args.request_rates:
        rates = [float(x) for x in args.request_rates.split(",") if x.strip()]
    elif args.request_rate is not None or "request_rate" in preset:
        rates = [float(pick("request_rate"))]
    elif args.workload == "W3":
        raise SystemExit("pagedserve bench: W3 needs --request-rate R or --request-rates R1,R2,...")
    else:
        rates = [float(DEFAULTS["request_rate"])]
    if any(r <= 0 for r in rates):
        raise SystemExit("pagedserve bench: request rates must be positive")
    return workload, rates


def _rate_label(rate: float) -> str:
    return "rate inf" if math.isinf(rate) else f"rate {rate:g}"


def _measure(
    address: str, workload: Workload, rates: Sequence[float], args: argparse.Namespace, tag: str = ""
) -> tuple[list[BenchRequest], list[PassResult]]:
    """Every pass against one server: model info, optional warmup, one pass per rate.

    Pass k draws its prompts with seed + k: the first pass sends exactly the workload, and later
    passes of a sweep do not find their prompts in the prefix cache. Returns the first pass's
    requests (the ones the baselines replay) and the passes."""
    info = get_model_info(address)
    max_len = info.max_model_len or None
    options = SendOptions(
        args.temperature, args.ignore_eos, args.seed, args.max_concurrency, args.request_timeout
    )
    if args.num_warmups:
        warmup = warmup_requests(args.num_warmups, info.vocab_size, info.max_model_len)
        run_pass(address, warmup, math.inf, options, "warmup")
    passes, first = [], []
    for k, rate in enumerate(rates):
        requests = generate_requests(replace(workload, seed=workload.seed + k), info.vocab_size, max_len)
        first = first or requests
        parts = [tag] if tag else []
        if len(rates) > 1 or not tag:
            parts.append(_rate_label(rate))
        passes.append(run_pass(address, requests, rate, options, ", ".join(parts)))
        passes[-1].seed = workload.seed + k
    return first, passes


def run_pagedserve(
    args: argparse.Namespace, workload: Workload, rates: Sequence[float]
) -> tuple[list[BenchRequest], list[PassResult]]:
    """All pagedserve passes: against --host/--port, or launched servers (twice to compare caching)."""
    if not args.launch:
        return _measure(f"{args.host}:{args.port}", workload, rates, args)
    log_dir = args.log_dir or args.result_file.parent / "logs"
    executor_args, scheduler_args = shlex.split(args.executor_args), shlex.split(args.scheduler_args)
    settings = [(None, scheduler_args)]
    if args.compare_prefix_caching:
        settings = [(True, scheduler_args), (False, [*scheduler_args, "--no-enable-prefix-caching"])]
    passes: list[PassResult] = []
    for caching, sched in settings:
        tag = "" if caching is None else f"prefix caching {'on' if caching else 'off'}"
        sub_dir = log_dir if caching is None else log_dir / ("caching-on" if caching else "caching-off")
        with launched_server(args.model, sub_dir, executor_args, sched, args.launch_timeout) as address:
            requests, results = _measure(address, workload, rates, args, tag)
        for result in results:
            result.prefix_caching = caching
        passes += results
    return requests, passes


def caching_comparison(on: PassResult, off: PassResult, greedy: bool) -> dict:
    """W2's report: prefill work, hit rate and total time with prefix caching on vs off."""
    run_on, run_off = summarize(on), summarize(off)
    s_on, s_off = run_on["server"] or {}, run_off["server"] or {}
    computed_on, computed_off = s_on.get("prompt_tokens_computed"), s_off.get("prompt_tokens_computed")
    outputs = compare_outputs(on, off)
    comparison = {
        "prefill tokens computed (on)": computed_on,
        "prefill tokens computed (off)": computed_off,
        "prefill computed ratio on/off": computed_on / computed_off if computed_on and computed_off else None,
        "prefix cache hit rate (on, hit/query)": s_on.get("prefix_cache_hit_rate"),
        "cached prompt tokens (on, usage)": run_on["cached_prompt_fraction"],
        "total time on (s)": run_on["duration_s"],
        "total time off (s)": run_off["duration_s"],
        "total time ratio on/off": run_on["duration_s"] / run_off["duration_s"],
        "greedy outputs identical": outputs["identical"] if greedy else None,
        "requests compared": outputs["compared"],
    }
    if outputs["differing"]:
        comparison["differing request indices"] = ",".join(map(str, outputs["differing"]))
    return comparison


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    workload, rates = resolve(args)
    if (args.launch or args.baseline) and not args.model:
        raise SystemExit("pagedserve bench: --launch and --baseline need --model DIR")
    if args.compare_prefix_caching and not args.launch:
        raise SystemExit("pagedserve bench: --compare-prefix-caching needs --launch")

    requests, passes = run_pagedserve(args, workload, rates)
    runs = [summarize(p) for p in passes]
    comparison = None
    if args.compare_prefix_caching:  # passes: [on at each rate..., off at each rate...]
        comparison = caching_comparison(passes[0], passes[len(passes) // 2], args.temperature == 0)
    report = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "workload_resolved": {
                k: str(v) if isinstance(v, LengthRange) else v for k, v in vars(workload).items()
            },
            "request_rates": ["inf" if math.isinf(r) else r for r in rates],
        },
        "runs": runs,
        "comparison": comparison,
        "baselines": [],
    }
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(report, indent=2) + "\n")  # again below, with baselines
    if not args.no_plot:
        write_plot(args.plot or args.result_file.with_suffix(".png"), runs, passes)

    subset = requests[: args.baseline_num_prompts]  # the very requests the first pass sent
    for name in args.baseline:
        print(f"bench: baseline {name} on {len(subset)} of {len(requests)} requests", file=sys.stderr)
        if name == "hf-static":
            result = run_hf_static(args.model, subset, args.baseline_batch_size, args.baseline_device)
        else:
            result = run_hf_cb(args.model, subset, args.baseline_device)
        report["baselines"].append(result)
        args.result_file.write_text(json.dumps(report, indent=2) + "\n")

    print(results_table(runs, comparison))
    if report["baselines"]:
        print()
        print(baseline_table(runs[0], report["baselines"], workload.num_prompts))
    print(f"\nresults: {args.result_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
