"""Starts executors and a scheduler as processes on loopback for `--launch`.

With `--data-parallel-size N`, N executors are placed on GPUs (or CPU threads) exactly as
`pagedserve serve --data-parallel-size N` places them (`pagedserve.supervisor.place_executors`),
and the scheduler gets one `--executor` flag per executor.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import grpc

from pagedserve.bench.client import get_model_info
from pagedserve.protos import admin_pb2, admin_pb2_grpc, executor_pb2, executor_pb2_grpc
from pagedserve.supervisor import place_executors, visible_gpu_count

REPO = Path(__file__).resolve().parent.parent.parent


class LaunchError(RuntimeError):
    """A launched service exited or never answered; the message ends with its log."""


_handed_out: set[int] = set()
PORT_SLICE = 1000  # ports a process picks from (see _port_candidates)
_slice: tuple[int, range, IO[str] | None] | None = None  # (owner pid, its ports, the lock held open)


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def _below_ephemeral() -> range:
    return range(10000, _ephemeral_ports().start)


def _port_candidates() -> range:
    """The ports this process picks from: a slice of the range below the ephemeral ports that no
    other process calling free_port holds (parallel test workers, benchmarks, their launchers).

    A pick is checked free, but its service binds it only seconds later, after loading: two
    processes picking at random from one range could both take it. Each process claims a slice
    by an exclusive lock on a file per slice, held open while the process lives (the kernel drops
    it at exit, so no claim goes stale). With every slice held: the whole range, as before."""
    global _slice
    below = _below_ephemeral()
    if _slice is not None and _slice[0] == os.getpid():
        return _slice[1]
    _slice = (os.getpid(), below, None)  # (a forked child claims a slice of its own)
    lock_dir = Path(tempfile.gettempdir()) / f"pagedserve-ports-{os.getuid()}"
    with contextlib.suppress(OSError):
        lock_dir.mkdir(exist_ok=True)
        for start in range(below.start, below.stop - PORT_SLICE + 1, PORT_SLICE):
            lock = open(lock_dir / f"{start}.lock", "w")  # noqa: SIM115 - held for the process's life
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                continue
            _slice = (os.getpid(), range(start, start + PORT_SLICE), lock)
            break
    return _slice[1]


def free_port() -> int:
    """A loopback TCP port that nothing listens on, for a service about to be started.

    Chosen below the kernel's ephemeral range: a port from bind(0) lies inside it, so in the moment
    before the service binds it any outgoing connection (each gRPC channel opens some) may take it as
    its source port, and the service then fails with "Address already in use". Ports already handed
    out by this process are not handed out again, nor those of other processes that call this
    (`_port_candidates`; past 200 tries there, the whole range below the ephemeral ports)."""
    for candidates in (_port_candidates(), _below_ephemeral()):
        for _ in range(200):
            port = random.choice(candidates) if candidates else 0  # (0: the kernel's choice)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise LaunchError("no free loopback port below the ephemeral range")


def _executor_answers(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True


def _check_alive(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            tail = logs[name].read_text(errors="replace")[-4000:]
            raise LaunchError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")


def _wait_until(
    ready, procs: dict[str, subprocess.Popen], logs: dict[str, Path], deadline: float, what: str
) -> None:
    while not ready():
        _check_alive(procs, logs)
        if time.monotonic() > deadline:
            raise LaunchError(
                f"{what} not ready; see {', '.join(sorted({str(p.parent) for p in logs.values()}))}"
            )
        time.sleep(0.5)


class LaunchedExecutors:
    """Executors launched by `launched_executors`; `scheduler()` starts a scheduler in front of them.

    Several schedulers may drive them one after another (`pagedserve tune` keeps the executors of
    one executor setting and restarts only the scheduler for scheduler-only settings): a scheduler
    stopped with SIGTERM gives the leases back, so the next one attaches at once, and since the
    prefix cache lives in the scheduler, each starts with an empty one."""

    def __init__(self, model: str, log_dir: Path, env: dict[str, str], deadline: float) -> None:
        self.model = model
        self.log_dir = log_dir
        self.env = env
        self.deadline = deadline
        self.addresses: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}  # each process's log file

    def start(
        self, name: str, cmd: list[str], child_env: dict[str, str], log_dir: Path | None = None
    ) -> None:
        log_dir = log_dir or self.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs[name] = log_dir / f"{name}.log"
        with open(self.logs[name], "w") as log:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=REPO
            )

    def stop(self, names: Sequence[str]) -> None:
        """SIGTERM, then SIGKILL after 15 s, in the order given."""
        procs = [self.procs.pop(name) for name in names if name in self.procs]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @contextlib.contextmanager
    def scheduler(
        self, scheduler_args: Sequence[str] = (), log_dir: Path | None = None, timeout: float | None = None
    ) -> Iterator[str]:
        """A scheduler over these executors; yields its address once GetModelInfo answers and every
        executor is attached (a pass that began with one would place its first requests all there),
        and stops it on exit (the executors keep running)."""
        log_dir = log_dir or self.log_dir
        port = free_port()
        address = f"127.0.0.1:{port}"
        command = [sys.executable, "-m", "pagedserve.scheduler", "--model", self.model, "--host", "127.0.0.1",
                   "--port", str(port), *(a for e in self.addresses for a in ("--executor", e)),
                   *scheduler_args]  # fmt: skip
        deadline = self.deadline if timeout is None else time.monotonic() + timeout
        try:
            self.start("scheduler", command, self.env, log_dir)
            print(
                f"bench: launched {len(self.addresses)} executor(s) + scheduler on {address} "
                f"(logs in {log_dir})",
                file=sys.stderr,
            )

            def scheduler_ready() -> bool:
                try:
                    get_model_info(address, timeout=2)
                    with grpc.insecure_channel(address) as channel:
                        listed = admin_pb2_grpc.AdminStub(channel).ListExecutors(
                            admin_pb2.ListExecutorsRequest(), timeout=2
                        )
                    return sum(e.attached for e in listed.executors) == len(self.addresses)
                except grpc.RpcError:
                    return False

            _wait_until(scheduler_ready, self.procs, self.logs, deadline, "services")
            yield address
        finally:
            self.stop(["scheduler"])


@contextlib.contextmanager
def launched_executors(
    model: str,
    log_dir: Path,
    executor_args: Sequence[str] = (),
    timeout: float = 900.0,
    data_parallel_size: int = 1,
    device: str = "auto",
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
) -> Iterator[LaunchedExecutors]:
    """Runs `data_parallel_size` executors as processes on loopback (placed as `pagedserve serve`
    places them) and stops them on exit, schedulers first.

    Args:
        device, gpu_memory_utilization, tensor_parallel_size: what `executor_args` set (the
            executors' placement divides the utilization among executors sharing a GPU, and gives
            each tensor-parallel executor its own GPUs).
        timeout: seconds until every service launched through the result (schedulers included)
            must serve.
    """
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
    services = LaunchedExecutors(model, log_dir, env, time.monotonic() + timeout)
    try:
        for p in placements:
            executor_port = free_port()
            address = f"127.0.0.1:{executor_port}"
            services.addresses.append(address)
            name = "executor" if data_parallel_size == 1 else f"executor-{p.index}"
            share = []
            if p.gpu_memory_utilization != gpu_memory_utilization:  # the last flag wins
                share = ["--gpu-memory-utilization", f"{p.gpu_memory_utilization:.4f}"]
            command = [sys.executable, "-m", "pagedserve.executor", "--model", model, "--host", "127.0.0.1",
                       "--port", str(executor_port), *executor_args, *share]  # fmt: skip
            services.start(name, command, {**env, **p.env})
            if p.shares_gpu:  # it sizes its KV pool from the GPU memory free when it starts
                _wait_until(
                    lambda a=address: _executor_answers(a),
                    services.procs,
                    services.logs,
                    services.deadline,
                    name,
                )
        yield services
    finally:
        services.stop(list(reversed(services.procs)))


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
    scheduler's address once every executor is attached, and stops them all (scheduler first) on
    exit. See `launched_executors` for the arguments."""
    with launched_executors(
        model, log_dir, executor_args, timeout, data_parallel_size, device, gpu_memory_utilization,
        tensor_parallel_size,
    ) as executors, executors.scheduler(scheduler_args) as address:  # fmt: skip
        yield address
