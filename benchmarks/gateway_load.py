"""What the OpenAI gateway itself costs in CPU, without a model: a stand-in scheduler answers
`Generate` at once and streams its tokens at a fixed pace (a message of `--tokens-per-message`
tokens every that many `--step-ms`: W1 on the H200 runs steps of ~31 ms with a message every 4
tokens), and `pagedserve openai` processes stand in front of it. The workload's requests go through
the gateway(s) with the `openai` client from 1..P client processes, as `pagedserve bench
--compare-openai` sends them. Reported per pass: how long the clients took to issue the requests,
TTFT (all of it overhead: the stand-in answers at once), the gap between messages against the
stand-in's pace, and the CPU seconds of the gateway(s) and the clients, per request and per message.

    python -m benchmarks.gateway_load --client-processes 1,4 --gateways 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
from pathlib import Path

from pagedserve.bench.client import SendOptions
from pagedserve.bench.launch import free_port
from pagedserve.bench.metrics import distribution
from pagedserve.bench.openai_client import launched_gateways, process_cpu_seconds, run_openai_pass
from pagedserve.bench.workloads import PRESETS, LengthRange, Workload, generate_requests
from pagedserve.common.tables import render_table

VOCAB = 128_256  # Llama 3's: the prompts' ids are as long in JSON as W1's on the H200


def _serve_stand_in(port: int, step_s: float, tokens_per_message: int, ready) -> None:
    """A Generation service without a model: the first token at once, then a message of
    `tokens_per_message` tokens every `tokens_per_message * step_s` until max_tokens."""
    import grpc

    from pagedserve.protos import generation_pb2, generation_pb2_grpc

    class StandIn(generation_pb2_grpc.GenerationServicer):
        async def GetModelInfo(self, request, context):
            return generation_pb2.ModelInfo(model="stand-in", max_model_len=1 << 16, vocab_size=VOCAB)

        async def Generate(self, request, context):
            total = request.stopping.max_tokens or 16
            prompt = len(request.token_ids.ids)
            sent = 0
            while sent < total:
                n = 1 if sent == 0 else min(tokens_per_message, total - sent)
                if sent:
                    await asyncio.sleep(n * step_s)
                ids = [(1000 + sent + i) % VOCAB for i in range(n)]
                sent += n
                last = sent == total
                yield generation_pb2.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=ids,
                    text="x" * n,
                    finish_reason=generation_pb2.FINISH_REASON_LENGTH if last else 0,
                    usage=generation_pb2.Usage(prompt_tokens=prompt, completion_tokens=sent)
                    if last
                    else None,
                )

    async def main() -> None:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(StandIn(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def measure(
    urls: list[str], pids: list[int], requests, processes: int, stream: bool, step_s: float, per_message: int
) -> dict:
    gateway_before = [process_cpu_seconds(p) or 0.0 for p in pids]
    label = f"P={processes} {'stream' if stream else 'plain'}"
    result = run_openai_pass(urls, None, requests, math.inf, SendOptions(), label, stream, processes)
    client_cpu = result.client_cpu_s or 0.0
    gateway_cpu = sum((process_cpu_seconds(p) or 0.0) - b for p, b in zip(pids, gateway_before, strict=True))
    ok = [r for r in result.records if r.ok]
    messages = sum(len(r.message_times) for r in ok)
    duration = result.end - result.start
    gaps = [b - a for r in ok for a, b in zip(r.message_times, r.message_times[1:], strict=False)]
    return {
        "pass": label,
        "gateways": len(urls),
        "requests ok / sent": f"{len(ok)} / {len(requests)}",
        "duration (s)": duration,
        "requests issued in (s)": max(r.start for r in result.records) - result.start,
        "TTFT p50 / p99 (ms)": "{p50:.0f} / {p99:.0f}".format(**distribution([r.ttft for r in ok])),
        "message gap p50 / p99 (ms)": "{p50:.0f} / {p99:.0f}".format(**distribution(gaps)) if gaps else "n/a",
        "stand-in's message gap (ms)": per_message * step_s * 1000,
        "messages (SSE chunks with tokens)": messages,
        "gateway CPU (s)": gateway_cpu,
        "gateway CPU / wall (cores)": gateway_cpu / duration,
        "gateway CPU ms per request": 1000 * gateway_cpu / len(requests),
        "client CPU (s, all processes, while sending)": client_cpu,
        "client CPU ms per request": 1000 * client_cpu / len(requests),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_load", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", default=PRESETS["W1"]["input_len"])
    p.add_argument("--output-len", default=PRESETS["W1"]["output_len"])
    p.add_argument("--step-ms", type=float, default=31.0, help="the stand-in's time per token")
    p.add_argument("--tokens-per-message", type=int, default=4, help="as the scheduler's --stream-interval")
    p.add_argument("--client-processes", default="1,4", help="comma-separated P, one pass each")
    p.add_argument("--gateways", type=int, default=1, help="gateway processes (clients spread over them)")
    p.add_argument("--no-plain", action="store_true", help="streamed passes only")
    p.add_argument("--log-dir", type=Path, default=Path("bench-results/gateway-load"))
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args(argv)
    workload = Workload(
        "random", args.num_prompts, LengthRange.parse(args.input_len), LengthRange.parse(args.output_len)
    )
    requests = generate_requests(workload, VOCAB)
    step_s = args.step_ms / 1000
    ctx = multiprocessing.get_context("spawn")
    ready, port = ctx.Event(), free_port()
    stand_in = ctx.Process(
        target=_serve_stand_in, args=(port, step_s, args.tokens_per_message, ready), daemon=True
    )
    stand_in.start()
    rows = []
    try:
        if not ready.wait(60):
            raise SystemExit("gateway_load: the stand-in scheduler did not start")
        with launched_gateways(f"127.0.0.1:{port}", args.log_dir, args.gateways) as gateways:
            urls, pids = [g.url for g in gateways], [g.pid for g in gateways]
            for stream in (True,) if args.no_plain else (True, False):
                for processes in (int(x) for x in args.client_processes.split(",")):
                    row = measure(urls, pids, requests, processes, stream, step_s, args.tokens_per_message)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    finally:
        stand_in.terminate()
        stand_in.join()
    names = list(rows[0])[1:]
    print(
        render_table(
            f"the gateway without a model ({os.cpu_count()} cores, {len(requests)} requests)",
            ["", *(r["pass"] for r in rows)],
            [[n, *(f"{r[n]:,.3f}" if isinstance(r[n], float) else str(r[n]) for r in rows)] for n in names],
        )
    )
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.result_file.write_text(json.dumps({"config": config, "passes": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
