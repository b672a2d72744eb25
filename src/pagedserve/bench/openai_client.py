"""The same passes through the OpenAI-compatible gateway, with the official `openai` async client:
what the HTTP layer in front of a scheduler costs (issue 15; goal <= 5% of throughput).

Each request is `completions.create` with the workload's prompt as token ids, its max_tokens,
`ignore_eos` and vLLM's `return_token_ids` (so the outputs compare token for token with the gRPC
pass), streamed or not. The scheduler's counters are read over gRPC, as in a gRPC pass.

    pagedserve bench --launch --model DIR --workload W1 --compare-openai
    pagedserve bench --workload W1 --port 50051 --through-openai http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from pagedserve.bench.client import PassResult, RequestRecord, SendOptions, _get_stats, measure_pass
from pagedserve.bench.launch import REPO, LaunchError, free_port
from pagedserve.bench.workloads import BenchRequest

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
        extra_body={"ignore_eos": options.ignore_eos, "return_token_ids": True},
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


async def _run_pass(
    url: str,
    scheduler: str | None,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    stream: bool,
) -> PassResult:
    import openai

    # A connection per request in flight, kept alive between passes (the client's default pool
    # holds 1,000, and keeps 100 alive). The Limits class is that of the client's HTTP library.
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=max(1000, len(requests)), max_keepalive_connections=len(requests)
    )
    async with openai.AsyncOpenAI(
        base_url=f"{url.rstrip('/')}/v1", api_key="unused", max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=None),
    ) as client:  # fmt: skip
        model = (await client.models.list()).data[0].id
        channel = grpc.aio.insecure_channel(scheduler) if scheduler else None
        try:

            async def get_stats():
                return await _get_stats(channel) if channel is not None else None

            return await measure_pass(
                lambda req: _send(client, model, req, options, stream),
                get_stats,
                requests,
                request_rate,
                options,
                label,
            )
        finally:
            if channel is not None:
                await channel.close()


def run_openai_pass(
    url: str,
    scheduler: str | None,
    requests: Sequence[BenchRequest],
    request_rate: float,
    options: SendOptions,
    label: str,
    stream: bool = True,
) -> PassResult:
    """Sends `requests` through the gateway at `url`; `scheduler` (host:port) for its counters."""
    return asyncio.run(_run_pass(url, scheduler, requests, request_rate, options, label, stream))


@contextlib.contextmanager
def launched_gateway(scheduler: str, log_dir: Path, timeout: float = 60.0) -> Iterator[str]:
    """`pagedserve openai` in front of `scheduler`, as a process; yields its URL once it is healthy."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "pagedserve.entrypoints.openai",
        "--port",
        str(port),
        "--scheduler",
        scheduler,
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "gateway.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                tail = (log_dir / "gateway.log").read_text(errors="replace")[-4000:]
                raise LaunchError(f"gateway exited with {proc.returncode}; its log ends:\n{tail}")
            with contextlib.suppress(OSError):  # refused, or 503 (HTTPError) until the scheduler answers
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            if time.monotonic() > deadline:
                raise LaunchError(f"gateway not healthy after {timeout:.0f} s; see {log_dir}")
            time.sleep(0.3)
        print(f"bench: launched the OpenAI gateway at {url} in front of {scheduler}", file=sys.stderr)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
