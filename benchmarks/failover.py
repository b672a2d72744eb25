"""Failover figures: kill -9 an executor that holds streams, again and again, and measure what its
clients see (issue 13).

    python -m benchmarks.failover --kills 10                 # tiny model, CPU, 4 executors

One scheduler over N executor processes on loopback. Each round starts `--streams` greedy
streams, waits until every one has begun, kills (SIGKILL) the executor running most of them, and
restarts it on its port in the background (a round needs two executors attached, not all). For each
stream it records the time from the kill to its next token; the slowest stream's wait is the time
from kill -9 to the first token after re-placement (the loss noticed, the request recomputed
elsewhere from prompt + tokens streamed). Every stream's tokens are compared with the same request
served undisturbed first: duplicated and lost tokens (both must be 0) are counted apart from tokens
that differ in value, which float32 never shows and bf16 may (a near-tie that flips when the
recomputed request lands in another batch).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from pagedserve.bench.launch import free_port
from pagedserve.client import generate, make_request, stream
from pagedserve.protos import admin_pb2, admin_pb2_grpc


def list_executors(address: str) -> list[admin_pb2.ExecutorStatus]:
    with grpc.insecure_channel(address) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        return list(stub.ListExecutors(admin_pb2.ListExecutorsRequest(), timeout=10).executors)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.failover", description=__doc__)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--executors", type=int, default=4)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--executor-args", default="--device=cpu --dtype=float32 --swap-space=0.1")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        if args.model is None:
            from pagedserve.tiny_model import write_tiny_model

            args.model = str(write_tiny_model(stack.enter_context(tempfile.TemporaryDirectory())))
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        py = sys.executable
        ports = [free_port() for _ in range(args.executors)]
        cmds = [
            [
                py,
                "-m",
                "pagedserve.cli",
                "executor",
                f"--model={args.model}",
                f"--port={p}",
                *args.executor_args.split(),
            ]
            for p in ports
        ]
        procs: list[subprocess.Popen] = []

        def start(i: int) -> subprocess.Popen:
            log = open(logs / f"executor{i}.log", "a")  # noqa: SIM115 - closed with the process
            return subprocess.Popen(cmds[i], stdout=log, stderr=subprocess.STDOUT)

        port = free_port()
        address = f"127.0.0.1:{port}"
        procs = [start(i) for i in range(args.executors)]
        scheduler = subprocess.Popen(
            [py, "-m", "pagedserve.cli", "scheduler", f"--model={args.model}", f"--port={port}"]
            + [f"--executor=127.0.0.1:{p}" for p in ports]
            + ["--executor-refresh-interval=1"],
            stdout=open(logs / "scheduler.log", "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

        def stop_all() -> None:
            for proc in [scheduler, *procs]:
                proc.kill()

        stack.callback(stop_all)

        def all_attached() -> bool:
            with contextlib.suppress(grpc.RpcError):
                rows = list_executors(address)
                return len(rows) == args.executors and all(r.attached for r in rows)
            return False

        while not all_attached():
            time.sleep(0.5)
        prompts = [[20 + i, 30 + i, 40 + i, 50 + i] * 3 for i in range(args.streams)]
        with grpc.insecure_channel(address) as channel:
            reference = [
                list(generate(channel, make_request(p, max_tokens=args.max_tokens, temperature=0)).token_ids)
                for p in prompts
            ]
            gaps: list[float] = []
            duplicated = lost = differing = 0
            for round_ in range(args.kills):
                while sum(r.attached for r in list_executors(address)) < 2:  # somewhere to go
                    time.sleep(0.5)
                received: list[list[tuple[float, list[int]]]] = [[] for _ in prompts]
                started = threading.Barrier(len(prompts) + 1)

                def read(k: int, received=received, started=started) -> None:
                    request = make_request(prompts[k], max_tokens=args.max_tokens, temperature=0)
                    for n, response in enumerate(stream(channel, request, timeout=600)):
                        received[k].append((time.monotonic(), list(response.token_ids)))
                        if n == 0:
                            started.wait()

                readers = [threading.Thread(target=read, args=(k,)) for k in range(len(prompts))]
                for reader in readers:
                    reader.start()
                started.wait()
                rows = list_executors(address)
                victim_row = max(rows, key=lambda r: r.num_running)
                victim = ports.index(int(victim_row.address.rsplit(":", 1)[1]))
                counts = [len(r) for r in received]  # messages before the kill
                procs[victim].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                procs[victim].wait()
                procs[victim] = start(victim)
                for reader in readers:
                    reader.join()
                # The streams on the victim are the last to see a token after the kill: the
                # slowest one's wait is the time from kill -9 to the first token after re-placement.
                waits = [
                    next(t for t, _ in messages[counts[k] :] if t > killed_at) - killed_at
                    for k, messages in enumerate(received)
                    if any(t > killed_at for t, _ in messages[counts[k] :])
                ]
                gaps.append(max(waits))
                for k, messages in enumerate(received):
                    tokens = [t for _, ids in messages for t in ids]
                    duplicated += max(0, len(tokens) - len(reference[k]))
                    lost += max(0, len(reference[k]) - len(tokens))
                    differing += sum(a != b for a, b in zip(tokens, reference[k], strict=False))
                print(
                    f"kill {round_ + 1}: executor {victim}, kill -> next token {gaps[-1]:.3f} s", flush=True
                )
        p50, p99 = statistics.median(gaps), percentile(gaps, 0.99)
        print(
            f"{args.kills} kills: kill -9 -> first token after re-placement p50 {p50:.3f} s, p99 {p99:.3f} s"
        )
        print(f"duplicated tokens {duplicated}, lost tokens {lost}, tokens differing in value {differing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
