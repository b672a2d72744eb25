"""One scheduler over three executors, all real processes on loopback (CPU, float32): requests
spread over the executors and follow their cached prefix; an executor killed with SIGKILL or frozen
with SIGSTOP mid-stream loses no token (every stream completes with Hugging Face's greedy tokens)
and is attached again once it is back."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedserve.client import generate, make_request, stream
from pagedserve.protos import admin_pb2, admin_pb2_grpc
from tests.services import REPO, _env, compose_commands, free_port, hf_greedy, localize

pytestmark = pytest.mark.slow

NUM_EXECUTORS = 3
LONG = 200  # tokens of the streams that are interrupted (no EOS within them for these prompts)


@dataclass
class Pool:
    """A scheduler and its executors, as processes."""

    port: int
    executor_ports: list[int]
    executor_cmds: list[list[str]]
    executors: list[subprocess.Popen]
    scheduler: subprocess.Popen
    log_dir: Path

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def list_executors(self) -> dict[int, admin_pb2.ExecutorStatus]:
        """Executor index -> its row of Admin.ListExecutors."""
        with self.channel() as ch:
            reply = admin_pb2_grpc.AdminStub(ch).ListExecutors(admin_pb2.ListExecutorsRequest(), timeout=10)
        return {self.executor_ports.index(int(e.address.rsplit(":", 1)[1])): e for e in reply.executors}

    def start_executor(self, i: int) -> None:
        log = open(self.log_dir / f"executor{i}.log", "a")  # noqa: SIM115 - closed with the process
        self.executors[i] = subprocess.Popen(
            self.executor_cmds[i], stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO
        )

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.log_dir.glob("*.log")))

    def wait_all_attached(self, timeout: float = 120.0) -> dict[int, admin_pb2.ExecutorStatus]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.scheduler.poll() is None, f"the scheduler exited:\n{self.logs()}"
            with contextlib.suppress(grpc.RpcError):
                rows = self.list_executors()
                if len(rows) == len(self.executors) and all(r.attached for r in rows.values()):
                    return rows
            assert time.monotonic() < deadline, f"executors not attached: {rows}\n{self.logs()}"
            time.sleep(0.3)


@contextlib.contextmanager
def running_pool(model_dir: Path, log_dir: Path, num_executors: int) -> Iterator[Pool]:
    """docker-compose.yml's commands as processes: `num_executors` executors and one scheduler
    given each executor's address."""
    commands = compose_commands()
    log_dir.mkdir(parents=True, exist_ok=True)
    port, ports = free_port(), [free_port() for _ in range(num_executors)]
    executor_cmds = [
        localize(commands["executor"], model_dir, p, p) + ["--device=cpu", "--dtype=float32"] for p in ports
    ]
    scheduler_cmd = [
        arg
        for arg in localize(commands["scheduler"], model_dir, port, ports[0])
        if not arg.startswith("--executor")
    ]
    scheduler_cmd += [f"--executor=127.0.0.1:{p}" for p in ports] + ["--executor-refresh-interval=1"]
    pool = Pool(port, ports, executor_cmds, [None] * num_executors, None, log_dir)  # type: ignore[arg-type]
    try:
        for i in range(num_executors):
            pool.start_executor(i)
        log = open(log_dir / "scheduler.log", "w")  # noqa: SIM115 - closed with the process
        pool.scheduler = subprocess.Popen(
            scheduler_cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO
        )
        pool.wait_all_attached()
        yield pool
    finally:
        for proc in [pool.scheduler, *pool.executors]:
            if proc is not None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in [pool.scheduler, *pool.executors]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


@pytest.fixture(scope="module")
def pool(tiny_model_dir, tmp_path_factory):
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp("pool"), NUM_EXECUTORS) as p:
        yield p


def wait_idle(pool: Pool, timeout: float = 60.0) -> dict[int, admin_pb2.ExecutorStatus]:
    deadline = time.monotonic() + timeout
    while True:
        rows = pool.list_executors()
        if all(r.num_running == 0 and r.num_waiting == 0 for r in rows.values()):
            return rows
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)


def test_requests_spread_and_follow_their_prefix(pool):
    before = wait_idle(pool)
    prompts = [[20 + i, 30 + i, 40 + i] * (2 + i) for i in range(9)]
    with pool.channel() as channel, ThreadPoolExecutor(len(prompts)) as threads:
        requests = [make_request(p, max_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
        list(threads.map(lambda r: generate(channel, r, timeout=120), requests))
    spread = wait_idle(pool)
    routed = [spread[i].requests_routed - before[i].requests_routed for i in range(NUM_EXECUTORS)]
    assert all(n > 0 for n in routed), routed
    assert sum(routed) == len(prompts), routed

    prefix = [(7 * k) % 500 + 3 for k in range(256)]  # 16 full blocks
    with pool.channel() as channel:
        first = generate(channel, make_request(prefix + [11, 12], max_tokens=2, temperature=0), timeout=60)
        warm = wait_idle(pool)
        (home,) = [i for i in range(NUM_EXECUTORS) if warm[i].requests_routed > spread[i].requests_routed]
        results = [
            generate(
                channel, make_request(prefix + [13 + k] * (k + 1), max_tokens=2, temperature=0), timeout=60
            )
            for k in range(3)
        ]
    after = wait_idle(pool)
    assert first.usage.cached_prompt_tokens == 0
    assert [r.usage.cached_prompt_tokens for r in results] == [256] * 3
    assert after[home].requests_routed - warm[home].requests_routed == 3
    assert after[home].prefix_cache_hit_tokens - warm[home].prefix_cache_hit_tokens >= 3 * 256
    for i in set(range(NUM_EXECUTORS)) - {home}:
        assert after[i].requests_routed == warm[i].requests_routed


def interrupted_streams(pool: Pool, hf_model, fault) -> tuple[int, dict[int, admin_pb2.ExecutorStatus]]:
    """Starts six long greedy streams, applies `fault(i)` to the executor running most of them once
    every stream has begun, and checks that every stream completes with Hugging Face's tokens.
    Returns the faulted executor's index and the ListExecutors rows after the streams ended."""
    wait_idle(pool)
    prompts = [[20 + i, 30 + i, 40 + i, 50 + i] * 3 for i in range(6)]
    received: list[list[int]] = [[] for _ in prompts]
    errors: list[Exception] = []
    started = threading.Barrier(len(prompts) + 1)

    def read(k: int, channel: grpc.Channel) -> None:
        responses = stream(channel, make_request(prompts[k], max_tokens=LONG, temperature=0), timeout=240)
        try:
            first = next(responses)
            received[k] += first.token_ids
            started.wait(timeout=60)
            for response in responses:
                received[k] += response.token_ids
        except (grpc.RpcError, threading.BrokenBarrierError) as exc:
            errors.append(exc)

    with pool.channel() as channel:
        readers = [threading.Thread(target=read, args=(k, channel)) for k in range(len(prompts))]
        for reader in readers:
            reader.start()
        started.wait(timeout=60)
        rows = pool.list_executors()
        victim = max(rows, key=lambda i: rows[i].num_running)
        assert rows[victim].num_running > 0, rows
        fault(victim)
        for reader in readers:
            reader.join(timeout=200)
        assert not any(r.is_alive() for r in readers), "a stream hung"
    assert not errors, errors
    for prompt, tokens in zip(prompts, received, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, LONG)  # no duplicated, no missing token
    return victim, pool.list_executors()


def wait_reattached(pool: Pool, i: int, epoch: int) -> None:
    deadline = time.monotonic() + 120
    while not (row := pool.list_executors()[i]).attached or row.lease_epoch == epoch:
        assert time.monotonic() < deadline, f"executor {i} never came back: {row}\n{pool.logs()}"
        time.sleep(0.3)
    assert row.state == "attached"


def test_kill_9_of_a_busy_executor_loses_no_token(pool, hf_model):
    epochs = {i: r.lease_epoch for i, r in pool.list_executors().items()}

    def kill(i: int) -> None:
        pool.executors[i].kill()
        pool.executors[i].wait(timeout=10)

    victim, rows = interrupted_streams(pool, hf_model, kill)
    assert not rows[victim].attached, rows[victim]
    assert rows[victim].state.startswith("lost"), rows[victim]
    pool.start_executor(victim)  # the same port
    wait_reattached(pool, victim, epochs[victim])
    result = generate(pool.channel(), make_request([5, 6, 7], max_tokens=4, temperature=0), timeout=60)
    assert len(result.token_ids) == 4


def test_frozen_executor_is_lost_and_its_requests_continue_elsewhere(pool, hf_model):
    epochs = {i: r.lease_epoch for i, r in pool.list_executors().items()}
    frozen: list[int] = []

    def freeze(i: int) -> None:
        pool.executors[i].send_signal(signal.SIGSTOP)
        frozen.append(i)

    try:
        victim, rows = interrupted_streams(pool, hf_model, freeze)
        assert not rows[victim].attached, rows[victim]
        assert rows[victim].state.startswith("lost"), rows[victim]
    finally:
        for i in frozen:
            pool.executors[i].send_signal(signal.SIGCONT)
    wait_reattached(pool, victim, epochs[victim])
