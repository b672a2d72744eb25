"""Child processes of `pagedserve serve`: where each executor runs, and restarting the ones that die.

`serve --data-parallel-size N` runs N executors and one scheduler on loopback. Executors are
restarted when they die (the scheduler re-attaches to a restarted executor by itself), with
exponential backoff so one that crashes at startup (a bad model, a GPU out of memory) does not spin:
1 s, doubling up to 30 s, back to 1 s once it has run for a minute. A child that exits with status
78 (`os.EX_CONFIG`: an executor's model, flags or KV pool size are wrong) is not restarted, since
no restart would fix it: `serve` stops with that status, after the child's own error line. The
scheduler is the service clients talk to: when it dies `serve` ends with its exit code (a
supervisor of `serve` itself, systemd or Kubernetes, decides what happens next).

GPU placement (`place_executors`): with at least N GPUs visible, executor i gets GPU i alone
(CUDA_VISIBLE_DEVICES). With G < N GPUs, executor i gets GPU i mod G, and its
--gpu-memory-utilization is the flag's value divided by the number of executors on that GPU, so
together they use what one executor would; executors that share a GPU are started one after
another (each once the one before answers), because each sizes its KV pool from the memory free
when it starts. On the CPU each of N > 1 executors gets cores / N threads (OMP_NUM_THREADS, unless
set already), so they do not fight over the same cores.

With `--tensor-parallel-size T` each executor is a group of T processes (executor.tp_workers) on T
GPUs: executor i gets GPUs i*T..i*T+T-1 (CUDA_VISIBLE_DEVICES lists them; its ranks use its local
devices 0..T-1), and N*T GPUs must be visible (tensor-parallel executors never share a GPU). On the
CPU the cores are split over all N*T processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("pagedserve.serve")


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff between restarts of a child that keeps dying."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0  # a child that ran this long before dying starts again at initial

    def next_backoff(self, previous_s: float | None, ran_for_s: float) -> float:
        """The wait before restarting a child that ran `ran_for_s` seconds; `previous_s` is the
        wait before its current run (None: it never was restarted)."""
        if previous_s is None or ran_for_s >= self.reset_after_s:
            return self.initial_backoff_s
        return min(previous_s * 2, self.max_backoff_s)


@dataclass(frozen=True)
class ExecutorPlacement:
    """Where executor `index` runs: its port, its GPU and its share of that GPU's memory."""

    index: int
    port: int
    env: Mapping[str, str]  # set on top of serve's own environment
    gpu_memory_utilization: float
    shares_gpu: bool  # another executor uses the same GPU: start them one after another


def place_executors(
    n: int,
    *,
    base_port: int,
    gpu_memory_utilization: float,
    num_gpus: int,
    visible_devices: str | None = None,
    num_cpus: int | None = None,
    tensor_parallel_size: int = 1,
) -> list[ExecutorPlacement]:
    """Ports executor_port + i, and the GPU assignment of the module docstring.

    Args:
        num_gpus: GPUs visible to `serve` (0: the executors run on the CPU).
        visible_devices: serve's own CUDA_VISIBLE_DEVICES, if set: executor i gets its i-th entry
            (its T entries from i*T on, with tensor parallelism).
        num_cpus: cores for CPU executors to split (default: those this process may run on).
        tensor_parallel_size: processes (and GPUs) per executor.

    Raises:
        ValueError: a size below 1, or fewer than n * tensor_parallel_size GPUs for T > 1.
    """
    if n < 1:
        raise ValueError(f"data parallel size must be at least 1, got {n}")
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {tp}")
    if num_gpus == 0:
        env: dict[str, str] = {}
        if n * tp > 1 and "OMP_NUM_THREADS" not in os.environ:
            cpus = num_cpus or len(os.sched_getaffinity(0))
            env["OMP_NUM_THREADS"] = str(max(1, cpus // (n * tp)))
        return [ExecutorPlacement(i, base_port + i, env, gpu_memory_utilization, False) for i in range(n)]
    ids = [d.strip() for d in visible_devices.split(",")] if visible_devices else []
    ids = ids[:num_gpus] if len(ids) >= num_gpus else [str(g) for g in range(num_gpus)]
    if tp > 1:
        if n * tp > num_gpus:
            raise ValueError(
                f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs, "
                f"{num_gpus} are visible"
            )
        envs = [{"CUDA_VISIBLE_DEVICES": ",".join(ids[i * tp : (i + 1) * tp])} for i in range(n)]
        return [
            ExecutorPlacement(i, base_port + i, env, gpu_memory_utilization, False)
            for i, env in enumerate(envs)
        ]
    placements = []
    for i in range(n):
        gpu = i % num_gpus
        sharing = len(range(gpu, n, num_gpus))  # executors on this GPU
        env = {"CUDA_VISIBLE_DEVICES": ids[gpu]}
        placements.append(
            ExecutorPlacement(i, base_port + i, env, gpu_memory_utilization / sharing, sharing > 1)
        )
    return placements


def visible_gpu_count(device: str) -> int:
    """GPUs the executors would use: 0 for --device cpu, or when no CUDA device is there."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class ChildSpec:
    """A process to run. With `ready` (whether it serves yet), the next child starts only once it
    answers."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)  # on top of os.environ
    restart: bool = False  # restart it when it dies (else its exit ends the supervisor)
    ready: Callable[[], bool] | None = None
    stop_grace_s: float = 0.0  # extra time it may take to exit after SIGTERM (a draining scheduler)


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff_s: float | None = None  # the wait before the current run; None before any restart
    restart_at: float | None = None  # when a dead child is due to start again
    restarts: int = 0


def exit_status(returncode: int) -> int:
    """serve's status for a child's: killed by signal N is 128 + N, as a shell says; 0 is kept."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Starts children in order, restarts the restartable ones with backoff, stops them all.

    `popen` and `clock` are injectable so the restart policy is tested without real processes.
    """

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        policy: RestartPolicy = RestartPolicy(),
        *,
        popen: Callable[..., subprocess.Popen] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._popen = popen or subprocess.Popen
        self._clock = clock
        self._children = [_Child(spec) for spec in specs]

    def pid(self, name: str) -> int | None:
        child = self._find(name)
        return None if child.proc is None else child.proc.pid

    def restarts(self, name: str) -> int:
        return self._find(name).restarts

    def start(
        self, should_stop: Callable[[], bool] = lambda: False, ready_timeout_s: float = 900.0
    ) -> int | None:
        """Starts every child in order, waiting after one with `ready` until it answers (or
        `should_stop()`). Returns an exit status if a child that is not restarted died meanwhile
        (then nothing more was started), else None."""
        for child in self._children:
            if should_stop():
                return None
            self._spawn(child)
            if child.spec.ready is None:
                continue
            deadline = self._clock() + ready_timeout_s
            while not should_stop() and not child.spec.ready():
                status = self.check()
                if status is not None:
                    return status
                if self._clock() > deadline:
                    log.error("serve.not_ready", child=child.spec.name, waited_s=ready_timeout_s)
                    return 1
                time.sleep(0.2)
        return None

    def check(self) -> int | None:
        """One pass: schedules restarts of children that died, starts those that are due. Returns
        the status `serve` ends with when a child that is not restarted has exited."""
        now = self._clock()
        for child in self._children:
            if child.proc is None:
                if child.restart_at is not None and now >= child.restart_at:
                    child.restarts += 1
                    self._spawn(child)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            ran_for = now - child.started
            if not child.spec.restart:
                log.error("serve.child_exited", child=child.spec.name, returncode=code)
                return exit_status(code) or 1
            if code == os.EX_CONFIG:
                log.error("serve.child_misconfigured", child=child.spec.name, returncode=code)
                return code
            child.backoff_s = self.policy.next_backoff(child.backoff_s, ran_for)
            child.restart_at = now + child.backoff_s
            child.proc = None
            log.warning(
                "serve.child_died",
                child=child.spec.name,
                returncode=code,
                ran_for_s=round(ran_for, 1),
                restart_in_s=child.backoff_s,
            )
        return None

    def run(self, should_stop: Callable[[], bool], poll_s: float = 0.2) -> int | None:
        """Supervises until `should_stop()` (returns None) or a non-restarted child exits."""
        while not should_stop():
            status = self.check()
            if status is not None:
                return status
            time.sleep(poll_s)
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops the children in reverse start order, each alone until it exited: the gateway and
        the scheduler before the executors, so the scheduler can drain its streams on executors
        that still run. SIGTERM, then SIGKILL after `timeout_s` plus the child's `stop_grace_s`."""
        for child in reversed(self._children):
            if child.proc is None:
                continue
            if child.proc.poll() is None:
                child.proc.terminate()
            try:
                child.proc.wait(timeout=timeout_s + child.spec.stop_grace_s)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def _spawn(self, child: _Child) -> None:
        env = {**os.environ, **child.spec.env} if child.spec.env else None
        child.proc = self._popen(list(child.spec.argv), env=env)
        child.started = self._clock()
        child.restart_at = None
        log.info("serve.child_started", child=child.spec.name, pid=child.proc.pid, restarts=child.restarts)

    def _find(self, name: str) -> _Child:
        for child in self._children:
            if child.spec.name == name:
                return child
        raise KeyError(name)


def install_stop_handlers() -> Callable[[], bool]:
    """SIGTERM and SIGINT set a flag; returns the function that reads it."""
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return lambda: stopping


__all__ = [
    "ChildSpec",
    "ExecutorPlacement",
    "RestartPolicy",
    "Supervisor",
    "exit_status",
    "install_stop_handlers",
    "place_executors",
    "visible_gpu_count",
]
