"""Starts the executor and scheduler as real processes on loopback, as docker-compose.yml does."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from pagedserve.protos import (
    admin_pb2,
    admin_pb2_grpc,
    executor_pb2,
    executor_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose_commands() -> dict[str, list[str]]:
    """The `command` of each service in docker-compose.yml, with ${VAR:-default} resolved."""
    spec = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    commands = {}
    for name, service in spec["services"].items():
        resolved = []
        for arg in service["command"]:
            while "${" in arg:  # ${NAME:-default} -> default (tests never set these variables)
                start = arg.index("${")
                end = arg.index("}", start)
                arg = arg[:start] + arg[start:end].split(":-", 1)[1] + arg[end + 1 :]
            resolved.append(arg)
        commands[name] = resolved
    return commands


def localize(command: list[str], model_dir: Path, port: int, executor_port: int) -> list[str]:
    """Maps a compose command onto this machine: the model path, loopback and free ports."""
    assert command[0] == "pagedserve"
    out = [sys.executable, "-m", "pagedserve.cli", *command[1:]]
    replacements = {
        "--model=/model": f"--model={model_dir}",
        "--host=0.0.0.0": "--host=127.0.0.1",
        "--port=50061": f"--port={port}",
        "--port=50051": f"--port={port}",
        "--executor=executor:50061": f"--executor=127.0.0.1:{executor_port}",
    }
    return [replacements.get(arg, arg) for arg in out]


@dataclass
class Services:
    """Handles to a running executor + scheduler pair."""

    port: int
    executor_port: int
    executor: subprocess.Popen
    scheduler: subprocess.Popen
    log_dir: Path
    executor_cmd: list[str]

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def executor_stats(self) -> executor_pb2.ExecutorStats:
        with grpc.insecure_channel(f"127.0.0.1:{self.executor_port}") as ch:
            return executor_pb2_grpc.ExecutorStub(ch).GetStats(executor_pb2.GetStatsRequest(), timeout=10)

    def scheduler_log(self) -> str:
        return (self.log_dir / "scheduler.log").read_text(errors="replace")

    def executor_log(self) -> str:
        return (self.log_dir / "executor.log").read_text(errors="replace")

    def restart_executor(self) -> None:
        """Kills the executor (as a crash would) and starts a new one on the same port."""
        self.executor.kill()
        self.executor.wait(timeout=10)
        self.start_executor()

    def start_executor(self) -> None:
        """Starts the executor again (after it was killed or stopped) on the same port."""
        log = open(self.log_dir / "executor.log", "a")  # noqa: SIM115 - closed with the process
        self.executor = subprocess.Popen(
            self.executor_cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO
        )


def wait_until_ready(services: Services, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with services.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            for proc, name in ((services.executor, "executor"), (services.scheduler, "scheduler")):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode}:\n{getattr(services, name + '_log')()}"
                    )
            try:
                stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=2)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"services not ready\n{services.executor_log()}\n{services.scheduler_log()}"
                    ) from None
                time.sleep(0.3)


@contextlib.contextmanager
def running_services(
    model_dir: Path,
    log_dir: Path,
    executor_args: tuple[str, ...] = (),
    scheduler_args: tuple[str, ...] = (),
) -> Iterator[Services]:
    """Runs docker-compose.yml's two commands as processes (CPU, float32), plus extra flags."""
    commands = compose_commands()
    port, executor_port = free_port(), free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    cmds = {
        "executor": localize(commands["executor"], model_dir, executor_port, executor_port)
        + ["--device=cpu", "--dtype=float32", *executor_args],
        "scheduler": localize(commands["scheduler"], model_dir, port, executor_port) + list(scheduler_args),
    }
    procs = []
    try:
        for name, cmd in cmds.items():
            log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO))
        services = Services(port, executor_port, procs[0], procs[1], log_dir, cmds["executor"])
        wait_until_ready(services)
        yield services
    finally:
        procs = [services.executor, services.scheduler] if "services" in locals() else procs
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def scheduler_stats(services: Services) -> admin_pb2.SchedulerStats:
    with services.channel() as ch:
        return admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetSchedulerStatsRequest(), timeout=10)


def wait_for_idle(services: Services, timeout: float = 20.0) -> admin_pb2.SchedulerStats:
    """Polls until no request is active and no GPU block is held (cached free blocks may stay)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = scheduler_stats(services)
        if stats.gpu_blocks_in_use == 0 and stats.num_active_requests == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: Hugging Face greedy generation of one unpadded prompt."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()
