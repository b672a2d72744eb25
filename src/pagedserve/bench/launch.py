"""Starts an executor and a scheduler as processes on loopback for `--launch`."""

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

REPO = Path(__file__).resolve().parent.parent.parent


class LaunchError(RuntimeError):
    """A launched service exited or never answered; the message ends with its log."""


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
        "executor": [sys.executable, "-m", "pagedserve.executor", "--model", model, "--host", "127.0.0.1",
                     "--port", str(executor_port), *executor_args],
        "scheduler": [sys.executable, "-m", "pagedserve.scheduler", "--model", model, "--host", "127.0.0.1",
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
                    raise LaunchError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")
            try:
                get_model_info(address, timeout=2)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise LaunchError(f"services not ready after {timeout:.0f} s; see {log_dir}") from None
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
