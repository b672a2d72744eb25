"""Starts executors and a scheduler as processes on loopback for `--launch`.

With `--data-parallel-size N`, N executors are placed on GPUs (or CPU threads) exactly as
`pagedserve serve --data-parallel-size N` places them (`pagedserve.supervisor.place_executors`),
and the scheduler gets one `--executor` flag per executor.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from pagedserve.bench.client import get_model_info
from pagedserve.protos import admin_pb2, admin_pb2_grpc, executor_pb2, executor_pb2_grpc
from pagedserve.supervisor import place_executors, visible_gpu_count

REPO = Path(__file__).resolve().parent.parent.parent


class LaunchError(RuntimeError):
    """A launched service exited or never answered; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _executor_answers(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True


def _check_alive(procs: dict[str, subprocess.Popen], log_dir: Path) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            tail = (log_dir / f"{name}.log").read_text(errors="replace")[-4000:]
            raise LaunchError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")


def _wait_until(ready, procs: dict[str, subprocess.Popen], log_dir: Path, deadline: float, what: str) -> None:
    while not ready():
        _check_alive(procs, log_dir)
        if time.monotonic() > deadline:
            raise LaunchError(f"{what} not ready; see {log_dir}")
        time.sleep(0.5)


@contextlib.contextmanager
def launched_server(
    model: str,
    log_dir: Path,
    executor_args: Sequence[str] = (),
    scheduler_args: Sequence[str] = (),
    timeout: float = 900.0,
    data_parallel_size: int = 1,
    device: str = "auto",
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
) -> Iterator[str]:
    """Runs `data_parallel_size` executors and a scheduler as processes on loopback; yields the
    scheduler's address once GetModelInfo answers and every executor is attached (a pass that began
    with one would place its first requests all there), and stops them all (scheduler first) on exit.

    Args:
        device, gpu_memory_utilization, tensor_parallel_size: what `executor_args` set (the
            executors' placement divides the utilization among executors sharing a GPU, and gives
            each tensor-parallel executor its own GPUs).
    """
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    placements = place_executors(
        data_parallel_size,
        base_port=0,
        gpu_memory_utilization=gpu_memory_utilization,
        num_gpus=visible_gpu_count(device),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        tensor_parallel_size=tensor_parallel_size,
    )
    executors = []  # (name, command, env, wait until it answers before starting the next)
    addresses = []
    for p in placements:
        executor_port = free_port()
        addresses.append(f"127.0.0.1:{executor_port}")
        name = "executor" if data_parallel_size == 1 else f"executor-{p.index}"
        share = []
        if p.gpu_memory_utilization != gpu_memory_utilization:  # the last flag wins
            share = ["--gpu-memory-utilization", f"{p.gpu_memory_utilization:.4f}"]
        command = [sys.executable, "-m", "pagedserve.executor", "--model", model, "--host", "127.0.0.1",
                   "--port", str(executor_port), *executor_args, *share]  # fmt: skip
        executors.append((name, command, {**env, **p.env}, p.shares_gpu))
    scheduler = [sys.executable, "-m", "pagedserve.scheduler", "--model", model, "--host", "127.0.0.1",
                 "--port", str(port), *(a for address in addresses for a in ("--executor", address)),
                 *scheduler_args]  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout

    def start(name: str, cmd: list[str], child_env: dict[str, str]) -> None:
        with open(log_dir / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=REPO)

    try:
        for (name, cmd, child_env, one_at_a_time), executor_address in zip(executors, addresses, strict=True):
            start(name, cmd, child_env)
            if one_at_a_time:  # it sizes its KV pool from the GPU memory free when it starts
                _wait_until(lambda a=executor_address: _executor_answers(a), procs, log_dir, deadline, name)
        start("scheduler", scheduler, env)
        print(
            f"bench: launched {len(executors)} executor(s) + scheduler on {address} (logs in {log_dir})",
            file=sys.stderr,
        )

        def scheduler_ready() -> bool:
            try:
                get_model_info(address, timeout=2)
                with grpc.insecure_channel(address) as channel:
                    listed = admin_pb2_grpc.AdminStub(channel).ListExecutors(
                        admin_pb2.ListExecutorsRequest(), timeout=2
                    )
                return sum(e.attached for e in listed.executors) == data_parallel_size
            except grpc.RpcError:
                return False

        _wait_until(scheduler_ready, procs, log_dir, deadline, "services")
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
