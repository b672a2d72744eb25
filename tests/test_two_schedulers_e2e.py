"""Two schedulers over three executors, all real processes on loopback (CPU, float32): an executor
belongs to one scheduler at a time (no stealing), and when one scheduler is killed with SIGKILL the
other takes its executors once their leases expire (lease timeout plus a refresh) and serves them
with Hugging Face's greedy tokens."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.client import generate, make_request
from pagedserve.protos import admin_pb2, admin_pb2_grpc
from tests.services import REPO, _env, compose_commands, free_port, hf_greedy, localize

pytestmark = pytest.mark.slow

LEASE_TIMEOUT_S = 3
REFRESH_S = 1


def _list(port: int) -> dict[str, admin_pb2.ExecutorStatus]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = admin_pb2_grpc.AdminStub(channel).ListExecutors(admin_pb2.ListExecutorsRequest(), timeout=10)
    return {e.address: e for e in reply.executors}


def _attached(port: int) -> set[str]:
    with contextlib.suppress(grpc.RpcError):
        return {address for address, e in _list(port).items() if e.attached}
    return set()


def _epochs(ports: list[int]) -> dict[str, int]:
    """Each attached executor's lease epoch, over the schedulers at `ports`."""
    return {a: e.lease_epoch for p in ports for a, e in _list(p).items() if e.attached}


def _until(condition, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}\n{logs()}"
        time.sleep(0.2)


def test_two_schedulers_share_executors_without_stealing_and_take_over(
    tiny_model_dir: Path, hf_model, tmp_path: Path
):
    commands = compose_commands()
    executor_ports = [free_port() for _ in range(3)]
    scheduler_ports = [free_port() for _ in range(2)]
    addresses = [f"127.0.0.1:{p}" for p in executor_ports]
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        procs.append(proc)
        return proc

    def logs() -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp_path.glob("*.log")))

    try:
        for i, port in enumerate(executor_ports):
            argv = localize(commands["executor"], tiny_model_dir, port, port)
            start(
                f"executor{i}",
                [*argv, "--device=cpu", "--dtype=float32", f"--lease-timeout={LEASE_TIMEOUT_S}"],
            )
        schedulers = []
        for i, port in enumerate(scheduler_ports):
            argv = localize(
                commands["scheduler"], tiny_model_dir, port, [f"--executor={a}" for a in addresses]
            )
            # Later flags win: a short refresh, and at most two executors each.
            argv += [f"--executor-refresh-interval={REFRESH_S}", "--max-executors=2"]
            schedulers.append(start(f"scheduler{i}", argv))

        # Every executor ends up with exactly one scheduler, and each scheduler holds one or two.
        def shared_out() -> bool:
            a, b = _attached(scheduler_ports[0]), _attached(scheduler_ports[1])
            return not (a & b) and (a | b) == set(addresses) and bool(a) and bool(b)

        _until(shared_out, 180, "the executors were not shared out between the schedulers", logs)
        owners = [_attached(p) for p in scheduler_ports]
        epochs = _epochs(scheduler_ports)
        time.sleep(LEASE_TIMEOUT_S + 2 * REFRESH_S)  # idle: heartbeats keep every lease
        assert [_attached(p) for p in scheduler_ports] == owners  # no stealing
        assert {
            a: e.lease_epoch for p in scheduler_ports for a, e in _list(p).items() if e.attached
        } == epochs
        refused = [e for p in scheduler_ports for e in _list(p).values() if not e.attached]
        assert all(e.state.startswith(("refused", "spare")) for e in refused), refused

        # The scheduler with two executors dies; the other takes one of them over (it holds at
        # most two) within the lease timeout plus a refresh, and serves on both.
        victim = 0 if len(owners[0]) == 2 else 1
        survivor = 1 - victim
        schedulers[victim].send_signal(signal.SIGKILL)
        schedulers[victim].wait(timeout=10)
        _until(
            lambda: len(_attached(scheduler_ports[survivor])) == 2,
            LEASE_TIMEOUT_S + REFRESH_S + 15,
            "the surviving scheduler did not take an executor over",
            logs,
        )
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_ports[survivor]}") as channel:
            for prompt in prompts:
                response = generate(
                    channel, make_request(prompt, max_tokens=12, ignore_eos=True, temperature=0)
                )
                assert list(response.token_ids) == hf_greedy(hf_model, prompt, 12)
        routed = [e.requests_routed for e in _list(scheduler_ports[survivor]).values() if e.attached]
        assert sum(routed) == len(prompts)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
