"""`pagedserve serve` with the built-in model, `pagedserve generate` and `pagedserve health`, as a user
runs them: real processes, real ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.services import REPO, free_port

pytestmark = pytest.mark.slow


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


def test_serve_generate_health_and_shutdown(tmp_path):
    env = {**os.environ, "PAGEDSERVE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed with the process
    serve = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "serve", f"--port={port}", "--device=cpu",
         "--max-num-seqs=8", "--max-num-batched-tokens=512"],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while cli("health", f"--port={port}", env=env).returncode != 0:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "serve never became healthy"
            time.sleep(0.5)
        assert (tmp_path / "default-model" / "model.safetensors").exists()
        assert cli("health", "--executor", f"--port={port + 10}", env=env).returncode == 0

        result = cli(
            "generate",
            f"--port={port}",
            "The scheduler decides",
            "--max-tokens=8",
            "--temperature=0",
            env=env,
        )
        assert result.returncode == 0, result.stderr
        assert "finish=" in result.stderr and "completion_tokens=" in result.stderr

        bad = cli("generate", f"--port={port}", "x", "--temperature=-1", env=env)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    assert cli("health", f"--port={port}", "--timeout=1", env=env).returncode == 1


def test_serve_forwards_every_flag_it_accepts(tmp_path):
    """A flag `serve` accepts reaches the process it belongs to; none is dropped on the way."""
    import argparse

    from executor.config import ExecutorConfig, add_cli_args
    from pagedserve.cli import EXECUTOR_FLAGS, SCHEDULER_FLAGS, _forward, add_serve_args
    from scheduler.service_config import ServiceConfig

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    own = {"help", "model", "host", "port", "executor_port"}
    accepted = {action.dest for action in parser._actions} - own
    assert accepted == set(EXECUTOR_FLAGS) | set(SCHEDULER_FLAGS)

    trace = str(tmp_path / "trace.jsonl")
    args = parser.parse_args(["--step-trace", trace, "--stream-interval", "4", "--max-num-seqs", "64"])
    executor_parser = add_cli_args(argparse.ArgumentParser())
    executor = ExecutorConfig.from_args(
        executor_parser.parse_args(["--model", "m", *_forward(args, EXECUTOR_FLAGS)])
    )
    scheduler_parser = argparse.ArgumentParser()
    ServiceConfig.add_cli_args(scheduler_parser)
    service = ServiceConfig.from_args(
        scheduler_parser.parse_args(["--model", "m", *_forward(args, SCHEDULER_FLAGS)])
    )
    assert (executor.step_trace, executor.max_num_seqs) == (trace, 64)
    assert (service.stream_interval, service.max_num_seqs) == (4, 64)
