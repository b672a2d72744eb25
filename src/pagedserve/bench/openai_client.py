"""The same passes through the OpenAI-compatible gateway, with the official `openai` async client:
what the HTTP layer in front of a scheduler costs (issue 15; goal <= 5% of throughput).

Each request is `completions.create` with the workload's prompt as token ids, its max_tokens,
`ignore_eos` and vLLM's `return_token_ids` (so the outputs compare token for token with the gRPC
pass), streamed or not. The scheduler's counters are read over gRPC, as in a gRPC pass.

One Python process of the `openai` client needs ~15 ms of CPU to issue a W1 request (mostly its
`transform` of the prompt list), seconds for 512 at once: so a pass can deal its requests out to
several client processes that start at one instant, and merge their records (`processes`).

    pagedserve bench --launch --model DIR --workload W1 --compare-openai --openai-client-processes 8
    pagedserve bench --workload W1 --port 50051 --through-openai http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import grpc

from pagedserve.bench.client import (
    PassPeaks,
    PassResult,
    RequestRecord,
    SendOptions,
    _get_stats,
    measure_pass,
)
from pagedserve.bench.launch import REPO, LaunchError, free_port
from pagedserve.bench.workloads import BenchRequest, arrival_times

_FINISH = {"length": "FINISH_REASON_LENGTH", "stop": "FINISH_REASON_STOP", "abort": "FINISH_REASON_ABORT"}


async def _send(client, model: str, req: BenchRequest, options: SendOptions, stream: bool) -> RequestRecord:
    """One request through the gateway; records what the client saw, like the gRPC pass's `_send`."""
    import openai

    record = RequestRecord(req.index, len(req.prompt), req.output_len)
    kwargs = dict(
        model=model,
        prompt=list(req.prompt),
        max_tokens=req.output_len,
        temperature=options.temperature,
        seed=options.seed * 1_000_003 + req.index if options.temperature > 0 else None,
        extra_body={"ignore_eos": options.ignore_eos, "return_token_ids": True}
        | ({"structured_outputs": req.structured_outputs} if req.structured_outputs else {}),
        timeout=options.timeout,
    )
    record.start = time.perf_counter()
    try:
        if stream:
            chunks = await client.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
            async for chunk in chunks:
                if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                    record.cached_prompt_tokens = chunk.usage.prompt_tokens_details.cached_tokens or 0
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                ids = getattr(choice, "token_ids", None) or []
                if ids:
                    record.message_times.append(time.perf_counter())
                    record.message_tokens.append(len(ids))
                    record.token_ids.extend(ids)
                if choice.finish_reason:
                    record.finish_reason = _FINISH.get(choice.finish_reason, choice.finish_reason)
        else:
            response = await client.completions.create(**kwargs)
            choice = response.choices[0]
            ids = getattr(choice, "token_ids", None) or []
            record.message_times.append(time.perf_counter())
            record.message_tokens.append(len(ids))
            record.token_ids.extend(ids)
            record.finish_reason = _FINISH.get(choice.finish_reason, choice.finish_reason)
            details = response.usage.prompt_tokens_details if response.usage else None
            record.cached_prompt_tokens = (details.cached_tokens or 0) if details else 0
    except openai.APIError as exc:
        record.error = f"HTTP {getattr(exc, 'status_code', '?')}: {exc.message}"
    record.end = time.perf_counter()
    return record


def _client(url: str):
    """An `openai.AsyncOpenAI` whose HTTP pool opens a connection for every request in flight (the
    default pool holds 1,000 and keeps 100 alive; W1 sends 512 at once). The Limits class is that of
    the client's HTTP library."""
    import openai

    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=None, max_keepalive_connections=None)
    return openai.AsyncOpenAI(
        base_url=f"{url.rstrip('/')}/v1", api_key="unused", max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=None),
    )  # fmt: skip


async def _run_pass(
    url: str,
    scheduler: str | None,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    stream: bool,
) -> PassResult:
    async with _client(url) as client:
        model = (await client.models.list()).data[0].id
        channel = grpc.aio.insecure_channel(scheduler) if scheduler else None
        try:

            async def get_stats():
                return await _get_stats(channel) if channel is not None else None

            cpu = time.process_time()
            result = await measure_pass(
                lambda req: _send(client, model, req, options, stream),
                get_stats,
                requests,
                request_rate,
                options,
                label,
            )
            result.client_cpu_s = time.process_time() - cpu  # this process's, its stats reads included
            return result
        finally:
            if channel is not None:
                await channel.close()


def default_client_processes() -> int:
    """min(8, CPU cores): one Python process of the `openai` client spends ~14 ms of CPU issuing
    each request (README, "The OpenAI gateway's cost"), so 512 at once take seconds from one."""
    return max(1, min(8, os.cpu_count() or 1))


def run_openai_pass(
    urls: str | Sequence[str],
    scheduler: str | None,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    stream: bool = True,
    processes: int = 1,
) -> PassResult:
    """Sends `requests` through the gateway(s) at `urls`; `scheduler` (host:port) for its counters.

    With `processes` > 1 the requests are dealt round robin to that many client processes (each
    its own event loop and `openai.AsyncOpenAI`; process k talks to gateway k mod len(urls)), which
    all start at one common instant; their records are merged into one pass. A global
    `max_concurrency` needs one client, so it keeps the pass in this process."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    processes = min(processes, len(requests))
    if processes <= 1 or options.max_concurrency:
        return asyncio.run(_run_pass(urls[0], scheduler, requests, request_rate, options, label, stream))
    return asyncio.run(
        _run_pass_in_processes(urls, scheduler, requests, request_rate, options, label, stream, processes)
    )


# ---- several client processes ------------------------------------------------------------------
# perf_counter is CLOCK_MONOTONIC on Linux (and system-wide on macOS and Windows too): the times the
# client processes record are on one clock with the parent's, so the merged records need no shift.


@dataclass(frozen=True)
class _Share:
    """One client process's part of a pass: its requests, their send offsets from the common start."""

    url: str
    requests: list[BenchRequest]
    offsets: list[float]
    options: SendOptions
    stream: bool


def _client_process(conn: Connection, share: _Share, done: Synchronized) -> None:
    """A client process's whole life: connect, say "ready", wait for the start instant from the
    parent, send its requests at their offsets from it, send back the records and the CPU seconds
    that took (or the error)."""
    try:
        conn.send(("records", asyncio.run(_client_loop(conn, share, done))))
    except BaseException as exc:  # the parent reports it; nothing is left hanging in it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


async def _client_loop(
    conn: Connection, share: _Share, done: Synchronized
) -> tuple[list[RequestRecord], float]:
    async with _client(share.url) as client:
        model = (await client.models.list()).data[0].id
        conn.send(("ready", None))
        start = conn.recv()  # blocks this loop, which has nothing else to do yet

        async def send_at(req: BenchRequest, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            record = await _send(client, model, req, share.options, share.stream)
            with done.get_lock():
                done.value += 1
            return record

        cpu = time.process_time()
        records = await asyncio.gather(
            *(send_at(req, start + offset) for req, offset in zip(share.requests, share.offsets, strict=True))
        )
        return records, time.process_time() - cpu


def _receive(conn: Connection, proc: BaseProcess, expect: str, timeout: float):
    """The child's next message, which must be `expect`; its error, or its death, raises."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0):
            raise RuntimeError(f"{proc.name} exited with {proc.exitcode} before sending {expect!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} sent no {expect!r} in {timeout:.0f} s")
    kind, payload = conn.recv()
    if kind != expect:
        raise RuntimeError(f"{proc.name} failed: {payload}")
    return payload


async def _run_pass_in_processes(
    urls: Sequence[str],
    scheduler: str | None,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    stream: bool,
    processes: int,
) -> PassResult:
    """`measure_pass` with the sending spread over `processes` client processes (spawned, so none
    inherits this one's event loop or gRPC state). This process reads the scheduler's counters
    before, during and after, and keeps the progress bar; the pass starts once every client
    process is connected and waiting, at one instant they all sleep until."""
    from tqdm import tqdm

    arrivals = arrival_times(len(requests), request_rate, options.seed)
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Value("i", 0)
    children: list[tuple[BaseProcess, Connection]] = []
    loop = asyncio.get_running_loop()
    waiters = ThreadPoolExecutor(processes, thread_name_prefix="openai-client")  # one recv each
    channel = grpc.aio.insecure_channel(scheduler) if scheduler else None
    try:
        for k in range(processes):
            mine = range(k, len(requests), processes)  # round robin: every process gets all lengths
            share = _Share(
                urls[k % len(urls)], [requests[i] for i in mine], [arrivals[i] for i in mine], options, stream
            )
            conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_client_process, args=(child_conn, share, done), name=f"openai-client-{k}", daemon=True
            )
            proc.start()
            child_conn.close()
            children.append((proc, conn))
        for proc, conn in children:  # spawning and importing the client takes a second or so each
            await loop.run_in_executor(waiters, _receive, conn, proc, "ready", 120.0)
        before = await _get_stats(channel) if channel is not None else None
        peaks = PassPeaks()
        with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr) as bar:
            start = time.perf_counter() + 0.05  # every child is asleep in recv: they wake well before
            for _, conn in children:
                conn.send(start)
            results = [
                loop.run_in_executor(waiters, _receive, conn, proc, "records", 1e9) for proc, conn in children
            ]
            while not all(r.done() for r in results):  # the progress bar and this pass's peak KV use
                bar.update(done.value - bar.n)
                peaks.update(await _get_stats(channel) if channel is not None else None)
                await asyncio.wait(results, timeout=0.25)
            bar.update(done.value - bar.n)
            shares = await asyncio.gather(*results)
        records = sorted((r for shard, _ in shares for r in shard), key=lambda r: r.index)
        end = max((r.end for r in records), default=start)
        after = await _get_stats(channel) if channel is not None else None
        result = peaks.result(label, request_rate, records, start, end, before, after)
        result.client_cpu_s = sum(cpu for _, cpu in shares)
        return result
    finally:
        for proc, conn in children:
            conn.close()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        waiters.shutdown(wait=False, cancel_futures=True)
        if channel is not None:
            await channel.close()


@dataclass(frozen=True)
class LaunchedGateway:
    url: str
    pid: int  # for its CPU time (`process_cpu_seconds`)


@contextlib.contextmanager
def launched_gateways(
    scheduler: str, log_dir: Path, count: int = 1, timeout: float = 60.0
) -> Iterator[list[LaunchedGateway]]:
    """`count` `pagedserve openai` processes in front of `scheduler`, each on its own port (logs
    gateway.log, gateway-1.log, ...); yields them once every one is healthy."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs: list[tuple[subprocess.Popen, Path, str]] = []
    try:
        for k in range(count):
            port = free_port()
            log = log_dir / ("gateway.log" if k == 0 else f"gateway-{k}.log")
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.openai", "--port", str(port),
                   "--scheduler", scheduler]  # fmt: skip
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            procs.append((proc, log, f"http://127.0.0.1:{port}"))
        deadline = time.monotonic() + timeout
        for proc, log, url in procs:
            while True:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-4000:]
                    raise LaunchError(f"gateway exited with {proc.returncode}; its log ends:\n{tail}")
                with contextlib.suppress(OSError):  # refused, or 503 (HTTPError) until the scheduler answers
                    with urllib.request.urlopen(f"{url}/health", timeout=2):
                        break
                if time.monotonic() > deadline:
                    raise LaunchError(f"gateway not healthy after {timeout:.0f} s; see {log_dir}")
                time.sleep(0.3)
        urls = ", ".join(url for _, _, url in procs)
        print(f"bench: launched the OpenAI gateway(s) at {urls} in front of {scheduler}", file=sys.stderr)
        yield [LaunchedGateway(url, proc.pid) for proc, _, url in procs]
    finally:
        for proc, _, _ in procs:
            proc.terminate()
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def launched_gateway(scheduler: str, log_dir: Path, timeout: float = 60.0) -> Iterator[str]:
    """`pagedserve openai` in front of `scheduler`, as a process; yields its URL once it is healthy."""
    with launched_gateways(scheduler, log_dir, 1, timeout) as gateways:
        yield gateways[0].url


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a running process (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
