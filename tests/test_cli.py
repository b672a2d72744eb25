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
