"""`pagedserve serve` with the built-in model, `pagedserve generate` and `pagedserve health`, as a user
runs them: real processes, real ports."""

from __future__ import annotations

import argparse
import os
import signal
import socket
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
    """`serve` with no --model serves the built-in model (package data): GetModelInfo names its
    directory, and a completion is readable text (no U+FFFD)."""
    from pagedserve.bench.client import get_model_info
    from pagedserve.common.default_model import DEFAULT_MODEL_DIR

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
        assert get_model_info(f"127.0.0.1:{port}").model == str(DEFAULT_MODEL_DIR)
        assert cli("health", "--executor", f"--port={port + 10}", env=env).returncode == 0

        result = cli(
            "generate",
            f"--port={port}",
            "def fibonacci(n):",
            "--max-tokens=16",
            "--temperature=0",
            env=env,
        )
        assert result.returncode == 0, result.stderr
        assert "finish=" in result.stderr
        assert "completion_tokens=16" in result.stderr
        assert result.stdout.strip()
        assert "\ufffd" not in result.stdout

        bad = cli("generate", f"--port={port}", "x", "--temperature=-1", env=env)
        assert bad.returncode == 2  # a usage error, as argparse's own (issue 35)
        assert "error: --temperature: must be a number >= 0, got -1.0" in bad.stderr
        too_long = cli("generate", f"--port={port}", "x", "--max-tokens=100000", env=env)
        assert too_long.returncode == 2  # the scheduler's refusal, which knows max_model_len
        assert "error: --max-tokens: prompt (" in too_long.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    assert cli("health", f"--port={port}", "--timeout=1", env=env).returncode == 1


def test_serve_forwards_every_flag_it_accepts(tmp_path):
    """A flag `serve` accepts reaches the process it belongs to; none is dropped on the way, and
    `serve` defines none of the children's flags again (it takes their own definitions)."""
    from pagedserve.cli import (
        SHARED_FLAGS,
        add_serve_args,
        executor_parser,
        forwarded_flags,
        scheduler_parser,
    )
    from pagedserve.executor.config import ExecutorConfig, add_cli_args
    from pagedserve.scheduler.service_config import ServiceConfig

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    own = {"help", "model", "host", "port", "executor_port", "data_parallel_size", "openai_port"}
    own |= {"executor_metrics_port"}
    accepted = {action.dest for action in parser._actions} - own
    children = {a.dest for child in (executor_parser(), scheduler_parser()) for a in child._actions}
    assert accepted == children

    trace = str(tmp_path / "trace.jsonl")
    args = parser.parse_args(
        [
            "--step-trace",
            trace,
            "--stream-interval",
            "4",
            "--max-num-seqs",
            "64",
            "--no-enable-prefix-caching",
            "--internal-token-file",
            "token",
            "--client-rate-limit",
            "5",
            "--ssl-certfile",
            "public.pem",
            "--ssl-keyfile",
            "public.key",
            "--metrics-port",
            "9100",
            "--shutdown-grace",
            "5",
        ]
    )
    full_executor_parser = add_cli_args(argparse.ArgumentParser())
    executor = ExecutorConfig.from_args(
        full_executor_parser.parse_args(
            ["--model", "m", *forwarded_flags(args, executor_parser(), skip=("metrics_port",))]
        )
    )
    full_scheduler_parser = argparse.ArgumentParser()
    ServiceConfig.add_cli_args(full_scheduler_parser)
    scheduler_argv = [
        *forwarded_flags(args, scheduler_parser()),
        *forwarded_flags(args, executor_parser(), only=SHARED_FLAGS),
    ]
    service = ServiceConfig.from_args(full_scheduler_parser.parse_args(["--model", "m", *scheduler_argv]))
    assert (executor.step_trace, executor.max_num_seqs) == (trace, 64)
    assert (service.stream_interval, service.max_num_seqs, service.enable_prefix_caching) == (4, 64, False)
    # The token file goes to both; the public TLS and the throttle to the scheduler alone.
    assert executor.internal_token_file == service.internal_token_file == "token"
    assert service.client_rate_limit == 5
    assert (service.ssl_certfile, service.ssl_keyfile) == ("public.pem", "public.key")
    assert executor.ssl_certfile is None
    assert (service.metrics_port, service.shutdown_grace, executor.metrics_port) == (9100, 5.0, None)


def test_serve_checks_its_flags_before_starting_anything(tmp_path, monkeypatch, capsys):
    """A bad value is one usage error from `serve` itself: no model written, no child started."""
    from pagedserve import cli as pagedserve_cli

    monkeypatch.setattr(pagedserve_cli, "DEFAULT_MODEL_DIR", tmp_path / "default-model")
    monkeypatch.setattr(subprocess, "Popen", None)  # starting a child would fail
    for argv, flag in (
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--lease-timeout", "0"], "--lease-timeout"),
        (["--block-size", "0"], "--block-size"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--swap-space", "-1"], "--swap-space"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--stream-interval", "0"], "--stream-interval"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            pagedserve_cli.main(["serve", "--device", "cpu", *argv])
        assert exit_info.value.code == 2
        assert "pagedserve serve: error:" in (err := capsys.readouterr().err), err
        assert flag in err, err
    assert not (tmp_path / "default-model").exists()


def test_serve_exits_with_the_code_of_the_scheduler(monkeypatch):
    """The scheduler failing (its port taken, say) is why serve stops; the executor's exit is
    serve's own SIGTERM, so its -15 must not become serve's status (it came out as 241)."""
    from pagedserve import cli as pagedserve_cli
    from pagedserve import supervisor

    class Child:
        pid = 4242

        def __init__(self, cmd, **_kwargs):
            self.returncode = 1 if "pagedserve.scheduler" in cmd else None

        def poll(self):
            return self.returncode

        def terminate(self):
            self.returncode = -signal.SIGTERM

        def wait(self, timeout=None):
            return self.returncode

        def kill(self):
            self.returncode = -signal.SIGKILL

    monkeypatch.setattr(subprocess, "Popen", Child)
    monkeypatch.setattr(supervisor.signal, "signal", lambda *_: None)
    parser = argparse.ArgumentParser()
    pagedserve_cli.add_serve_args(parser)
    args = parser.parse_args(["--model", "m", "--device", "cpu", "--data-parallel-size", "2"])
    assert pagedserve_cli.serve(args) == 1


def test_services_report_startup_errors_in_one_line(tiny_model_dir):
    """A port in use or a --max-model-len the model cannot take: one line that says what to change,
    not a traceback (nor, for the executor, a port silently shared with another); exit 1, or 78
    (os.EX_CONFIG) where no restart can help (serve then stops instead of restarting)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    executor = ("executor", f"--model={tiny_model_dir}", "--device=cpu")
    scheduler = ("scheduler", f"--model={tiny_model_dir}", "--executor=127.0.0.1:1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = f"--port={taken.getsockname()[1]}"
        runs = {
            "executor, port in use": cli(*executor, port, env=env),
            "scheduler, port in use": cli(*scheduler, port, env=env),
        }
    too_long = "--max-model-len=99999"
    runs["executor, max-model-len"] = cli(*executor, f"--port={free_port()}", too_long, env=env)
    for name, run in runs.items():
        expected = os.EX_CONFIG if name == "executor, max-model-len" else 1
        assert run.returncode == expected, (name, run.stderr[-2000:])
        assert "Traceback" not in run.stderr, (name, run.stderr[-2000:])
    assert "is --port in use?" in runs["executor, port in use"].stderr
    assert "is --port in use?" in runs["scheduler, port in use"].stderr
    assert "max_model_len=99999 exceeds" in runs["executor, max-model-len"].stderr
