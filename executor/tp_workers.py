"""Tensor parallelism, the processes: rank 0 (the executor) starts ranks 1..N-1 and watches them.

`pagedserve executor --tensor-parallel-size N` is one process that serves gRPC (rank 0) plus N - 1
worker processes (`python -m pagedserve.executor.tp_workers`), started by rank 0 and meeting it
through a TCPStore on a free loopback port. The group lives and dies as one executor:

* a worker that dies (any exit before rank 0 asked it to stop) takes rank 0 down: rank 0's
  watchdog logs `executor.tp_worker_died`, kills the other workers and exits with status 1 at
  once (it may be blocked in a collective that will never complete), so the scheduler sees one
  executor lost and `pagedserve serve` restarts the whole group;
* a step that fails on rank 0 for any reason but a refused plan (a device error, say) ends the
  group the same way: the ranks may have applied different parts of it;
* rank 0 dying, even by SIGKILL, leaves no worker behind: each worker watches its parent and exits
  when it is gone (a collective with a dead rank 0 also fails);
* SIGTERM on rank 0 drains the gRPC service as usual, then sends the workers a stop message; they
  exit 0 (those that do not within a few seconds are killed). Workers ignore SIGINT and SIGTERM: a
  Ctrl-C of the terminal, `timeout`, or systemd signal every process of the group, and rank 0
  alone decides how the group stops (a worker that must go at once takes SIGKILL).

Bad values fail before any process starts (`check_config`): a size that does not divide the
model's heads, or one larger than the GPUs visible from rank 0's device on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import structlog
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.loader import load_model_spec
from pagedserve.executor.parallel import TensorParallelError, check_tensor_parallel
from pagedserve.executor.tp_group import Rendezvous, TensorParallelGroup, rank_device
from pagedserve.executor.tp_runner import TPDriverRunner, TPWorkerRunner, create_runner

log = structlog.get_logger(__name__)

WATCH_PERIOD_S = 0.2  # how often rank 0 looks at its workers, and a worker at its parent
STOP_TIMEOUT_S = 10.0  # a worker that has not exited this long after the stop message is killed


def check_config(config: ExecutorConfig) -> None:
    """Fails with a one-line TensorParallelError when --tensor-parallel-size cannot work here."""
    size = config.tensor_parallel_size
    check_tensor_parallel(load_model_spec(config.model), size)
    if size > 1 and config.torch_device().type == "cuda":
        base, count = torch.cuda.current_device(), torch.cuda.device_count()
        if base + size > count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise TensorParallelError(
                f"--tensor-parallel-size {size} needs GPUs {base}..{base + size - 1}, but {count} "
                f"are visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
            )


class TensorParallelWorkers:
    """Rank 0's side: the worker processes, their watchdog, the group and rank 0's runner."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs
        self.runner: TPDriverRunner | None = None
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="executor-tp-watchdog", daemon=True).start()

    @classmethod
    def start(cls, config: ExecutorConfig) -> TensorParallelWorkers:
        """Checks the config, starts ranks 1..N-1, joins the group as rank 0 and loads rank 0's
        shard (the workers load theirs at the same time)."""
        check_config(config)
        size = config.tensor_parallel_size
        device = config.torch_device()
        base = device.index or 0
        store = TensorParallelGroup.host_store(size)
        # Workers write no step trace of their own (rank 0's has every step) and serve no port.
        worker_config = dataclasses.replace(config, step_trace=None, metrics_port=None)
        payload = json.dumps(dataclasses.asdict(worker_config))
        procs = {}
        for rank in range(1, size):
            argv = [
                sys.executable, "-m", "pagedserve.executor.tp_workers", "--rank", str(rank),
                "--size", str(size), "--store-port", str(store.port), "--device-type", device.type,
                "--device-base", str(base), "--parent-pid", str(os.getpid()), "--config", payload,
            ]  # fmt: skip
            procs[rank] = subprocess.Popen(argv)
        workers = cls(procs)
        log.info(
            "executor.tp_started", tensor_parallel_size=size, worker_pids=[p.pid for p in procs.values()]
        )
        try:
            group = TensorParallelGroup(0, size, rank_device(device.type, base, 0), store)
            runner = create_runner(config, group)
        except BaseException:
            workers.kill()
            raise
        assert isinstance(runner, TPDriverRunner)
        runner.on_fatal = workers.fail
        workers.runner = runner
        return workers

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_PERIOD_S):
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                log.error("executor.tp_worker_died", rank=rank, pid=proc.pid, returncode=code)
                self.fail()

    def fail(self) -> None:
        """Ends the group at once: the workers are killed and this process exits with status 1
        (the ranks' state can no longer be trusted to agree; a collective may never complete)."""
        log.error("executor.tp_group_down", action="killing the workers, exiting with status 1")
        self.kill()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    def kill(self) -> None:
        """SIGKILLs every worker still running (a failed start, a dead peer)."""
        self._stopping.set()  # their deaths are expected now
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def stop(self) -> None:
        """Asks the workers to stop (after the service drained), waits for them, kills laggards."""
        self._stopping.set()
        if self.runner is not None:
            sender = threading.Thread(target=self.runner.stop_workers, daemon=True)
            sender.start()
            sender.join(STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("executor.tp_worker_killed", rank=rank, pid=proc.pid)
                proc.kill()
                proc.wait()
        if self.runner is not None:
            self.runner.group.close()
        log.info("executor.tp_stopped", returncodes={r: p.returncode for r, p in self.procs.items()})


def _watch_parent(parent_pid: int) -> None:
    """Exits this worker as soon as rank 0 is gone (reparented: getppid changes)."""
    while True:
        if os.getppid() != parent_pid:
            log.error("executor.tp_parent_gone", parent_pid=parent_pid, action="exiting")
            sys.stderr.flush()
            os._exit(1)
        time.sleep(WATCH_PERIOD_S)


def main(argv: list[str] | None = None) -> None:
    """A worker (rank >= 1): joins the group, loads its shard, runs rank 0's steps until told to stop."""
    parser = argparse.ArgumentParser(prog="pagedserve executor (tensor-parallel worker)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--device-type", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--device-base", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="the executor's config as JSON")
    args = parser.parse_args(argv)

    from pagedserve.common.logs import configure_logging

    configure_logging(f"executor-tp{args.rank}")
    for signum in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides (module docstring)
        signal.signal(signum, signal.SIG_IGN)
    threading.Thread(
        target=_watch_parent, args=(args.parent_pid,), name="tp-parent-watch", daemon=True
    ).start()
    config = ExecutorConfig(**json.loads(args.config))
    device = rank_device(args.device_type, args.device_base, args.rank)
    group = TensorParallelGroup.join(args.rank, args.size, device, Rendezvous("127.0.0.1", args.store_port))
    runner = create_runner(config, group)
    assert isinstance(runner, TPWorkerRunner)
    try:
        runner.serve()
    except Exception as exc:  # noqa: BLE001 - any failure ends this worker, and so the group
        _exit_on_failure(args.parent_pid, exc)
    group.close()
    log.info("executor.tp_worker_stopped", rank=args.rank)


def _exit_on_failure(parent_pid: int, exc: Exception) -> None:
    """Exits 1 with one log line. A collective fails first when rank 0 dies (its sockets close
    just before this process is reparented): that case is told apart by waiting a moment."""
    deadline = time.monotonic() + 1.0
    while os.getppid() == parent_pid and time.monotonic() < deadline:
        time.sleep(0.02)
    if os.getppid() != parent_pid:
        log.error("executor.tp_parent_gone", parent_pid=parent_pid, action="exiting")
    else:
        log.exception("executor.tp_worker_failed", error=f"{type(exc).__name__}: {exc}")
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    main()
