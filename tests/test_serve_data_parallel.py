"""`pagedserve serve --data-parallel-size 2 --device cpu` as a user runs it: two executor processes
and a scheduler; it answers Generate, and an executor killed with SIGKILL is started again on its
port by serve (which keeps running). An executor that cannot start (its model, its KV pool) ends
serve at once instead."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.client import generate as client_generate
from pagedserve.client import make_request
from pagedserve.protos import executor_pb2, executor_pb2_grpc
from tests.services import REPO, free_port

pytestmark = pytest.mark.slow


def consecutive_free_ports(n: int) -> int:
    """A port p such that p .. p + n - 1 are all free now."""
    for _ in range(50):
        base = free_port()
        sockets = []
        try:
            for i in range(n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def children_of(pid: int) -> dict[int, list[str]]:
    """{child pid: its command line}, read from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_text().split("\0")
        except (OSError, ValueError, IndexError):
            continue
    return out


def executor_pid(serve: subprocess.Popen, port: int) -> int | None:
    for pid, argv in children_of(serve.pid).items():
        if "pagedserve.executor" in argv and argv[argv.index("--port") + 1] == str(port):
            return pid
    return None


def executor_answers(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False


def generate(port: int, deadline_s: float = 60) -> list[int]:
    """A short greedy completion's tokens; retried while no executor is attached (UNAVAILABLE)."""
    deadline = time.monotonic() + deadline_s
    request = make_request("The scheduler decides", max_tokens=6, temperature=0.0, ignore_eos=True)
    while True:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                completion = client_generate(channel, request, timeout=30)
                assert completion.finish_reason
                assert len(completion.token_ids) == 6
                return completion.token_ids
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
        time.sleep(0.5)


def wait_for(condition, timeout: float, what: str, serve: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert serve.poll() is None, f"serve exited with {serve.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{what} after {timeout} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.3)


def stop(serve: subprocess.Popen, timeout: float = 40) -> int:
    """SIGTERM, then `serve`'s exit code; killed (and the timeout re-raised) if it does not exit."""
    serve.send_signal(signal.SIGTERM)
    try:
        return serve.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        serve.kill()
        raise


def test_serve_two_executors_generates_and_restarts_a_killed_executor(tiny_model_dir, tmp_path):
    port, executor_port = free_port(), consecutive_free_ports(2)
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(tiny_model_dir),
             f"--port={port}", f"--executor-port={executor_port}", "--data-parallel-size=2",
             "--device=cpu", "--max-num-seqs=8", "--max-num-batched-tokens=256", "--max-model-len=256",
             "--num-gpu-blocks-override=64", "--swap-space=0.01"],
            env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        ports = (executor_port, executor_port + 1)
        wait_for(lambda: all(executor_answers(p) for p in ports), 180, "executors not up", serve, log)
        tokens = generate(port)

        victim = executor_pid(serve, ports[0])
        survivor = executor_pid(serve, ports[1])
        assert victim
        assert survivor
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: (pid := executor_pid(serve, ports[0])) is not None and pid != victim,
            30, "the killed executor was not restarted", serve, log,
        )  # fmt: skip
        restarted = lambda: executor_answers(ports[0])  # noqa: E731
        wait_for(restarted, 120, "the restarted executor does not listen", serve, log)
        assert executor_pid(serve, ports[1]) == survivor  # the other one was left alone
        assert generate(port) == tokens  # greedy: the same completion
        assert "serve.child_died" in log.read_text()
    finally:
        code = stop(serve)
    assert code == 0, log.read_text()[-4000:]
    assert not children_of(serve.pid)


def _serve_fails_fast(model_dir: Path, tmp_path: Path, *flags: str) -> str:
    """Runs `serve` that cannot work; asserts it exits by itself, quickly, with the executor's
    configuration-error status (no restart loop), and returns what it printed."""
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model_dir),
             f"--port={free_port()}", f"--executor-port={free_port()}", "--device=cpu", *flags],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        code = serve.wait(timeout=90)
    except subprocess.TimeoutExpired:
        serve.kill()
        raise AssertionError(f"serve kept running:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert code == os.EX_CONFIG, text[-4000:]
    assert "serve.child_died" not in text  # never restarted
    assert not children_of(serve.pid)
    return text


def test_serve_with_an_unsupported_model_exits_naming_the_architecture(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    text = _serve_fails_fast(model, tmp_path)
    assert "architecture ['GPTNeoXForCausalLM'] is not supported" in text
    assert "LlamaForCausalLM" in text  # what is supported


def test_serve_with_a_kv_pool_too_small_for_max_model_len_exits_naming_the_fit(tiny_model_dir, tmp_path):
    text = _serve_fails_fast(tiny_model_dir, tmp_path, "--num-gpu-blocks-override=2", "--max-model-len=256")
    assert "cannot hold one sequence of max_model_len=256" in text
