"""`pagedserve serve`'s supervision: executors placed on GPUs, restarted with backoff; the
scheduler's exit ends serve. Policy on fake processes and a fake clock; the real thing (kill -9 of
an executor of `serve --data-parallel-size 2`) is in test_serve_data_parallel.py."""

from __future__ import annotations

import os

import pytest

from pagedserve.supervisor import ChildSpec, RestartPolicy, Supervisor, place_executors


def test_backoff_doubles_from_one_to_thirty_seconds_and_resets_after_a_minute_of_running():
    policy = RestartPolicy()
    waits, previous = [], None
    for _ in range(8):
        previous = policy.next_backoff(previous, ran_for_s=2.0)
        waits.append(previous)
    assert waits == [1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.next_backoff(30.0, ran_for_s=59.0) == 30
    assert policy.next_backoff(30.0, ran_for_s=60.0) == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeProcess:
    next_pid = 100
    started: list[FakeProcess] = []

    @classmethod
    def popen(cls, argv, env=None) -> FakeProcess:
        cls.started.append(cls(argv, env))
        return cls.started[-1]

    def __init__(self, argv, env=None) -> None:
        self.argv, self.env = argv, env
        self.returncode = None
        self.pid = FakeProcess.next_pid
        FakeProcess.next_pid += 1

    def poll(self):
        return self.returncode

    def terminate(self):
        if self.returncode is None:
            self.returncode = -15

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode


def test_a_dying_executor_is_restarted_with_backoff_and_the_scheduler_ending_ends_serve():
    clock, started = FakeClock(), []

    def popen(argv, env=None):
        started.append(FakeProcess(argv, env))
        return started[-1]

    specs = [
        ChildSpec("executor-0", ["exec", "0"], {"CUDA_VISIBLE_DEVICES": "0"}, restart=True),
        ChildSpec("scheduler", ["sched"]),
    ]
    supervisor = Supervisor(specs, popen=popen, clock=clock)
    assert supervisor.start() is None
    executor, scheduler = started
    assert executor.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "PATH" in executor.env
    assert scheduler.env is None  # serve's own environment

    def current_executor() -> FakeProcess:
        return next(p for p in reversed(started) if p.argv == ["exec", "0"])

    # It crashes three times in a row, quickly: 1 s, 2 s, 4 s before each restart.
    for wait in (1, 2, 4):
        current_executor().kill()
        clock.now += 0.5
        assert supervisor.check() is None
        clock.now += wait - 0.01
        supervisor.check()
        assert supervisor.pid("executor-0") is None  # not restarted yet
        clock.now += 0.02
        supervisor.check()
        assert supervisor.pid("executor-0") == current_executor().pid
        assert current_executor().returncode is None
    assert supervisor.restarts("executor-0") == 3

    # After a minute of running the backoff starts again at 1 s.
    clock.now += 61
    current_executor().kill()
    supervisor.check()
    clock.now += 1.0
    supervisor.check()
    assert supervisor.restarts("executor-0") == 4

    scheduler.returncode = 3
    assert supervisor.check() == 3
    supervisor.stop()
    assert current_executor().returncode == -15


def test_an_executor_exiting_with_a_configuration_error_ends_serve_without_a_restart():
    procs = []
    supervisor = Supervisor(
        [ChildSpec("executor-0", ["e"], restart=True), ChildSpec("scheduler", ["s"])],
        popen=lambda argv, env=None: procs.append(FakeProcess(argv)) or procs[-1],
    )
    supervisor.start()
    procs[0].returncode = os.EX_CONFIG
    assert supervisor.check() == os.EX_CONFIG
    assert supervisor.restarts("executor-0") == 0


def test_a_scheduler_killed_by_a_signal_ends_serve_with_128_plus_the_signal():
    procs = []
    supervisor = Supervisor(
        [ChildSpec("scheduler", ["s"])],
        popen=lambda argv, env=None: procs.append(FakeProcess(argv)) or procs[-1],
    )
    supervisor.start()
    procs[0].returncode = -9
    assert supervisor.check() == 137


def test_executors_sharing_a_gpu_start_one_after_another():
    ready: dict[str, int] = {}

    def is_ready() -> bool:
        ready["polls"] = ready.get("polls", 0) + 1
        return ready["polls"] > 2  # answers on the third probe

    specs = [
        ChildSpec("executor-0", ["e0"], restart=True, ready=is_ready),
        ChildSpec("executor-1", ["e1"], restart=True),
    ]
    supervisor = Supervisor(specs, popen=FakeProcess.popen)
    assert supervisor.start() is None
    assert [p.argv for p in FakeProcess.started[-2:]] == [["e0"], ["e1"]]
    assert ready["polls"] == 3


@pytest.mark.parametrize(
    ("n", "num_gpus", "visible", "expected"),
    [
        (2, 4, None, [("0", 0.9, False), ("1", 0.9, False)]),  # enough GPUs: one each
        (2, 2, "4,5", [("4", 0.9, False), ("5", 0.9, False)]),  # serve's own CUDA_VISIBLE_DEVICES
        (2, 1, None, [("0", 0.45, True), ("0", 0.45, True)]),  # one GPU: half each
        (3, 2, None, [("0", 0.45, True), ("1", 0.9, False), ("0", 0.45, True)]),
    ],
)
def test_gpu_placement(n, num_gpus, visible, expected):
    placements = place_executors(
        n, base_port=50061, gpu_memory_utilization=0.9, num_gpus=num_gpus, visible_devices=visible
    )
    assert [p.port for p in placements] == [50061 + i for i in range(n)]
    got = [(p.env["CUDA_VISIBLE_DEVICES"], p.gpu_memory_utilization, p.shares_gpu) for p in placements]
    assert got == [(d, pytest.approx(u), s) for d, u, s in expected]


def test_cpu_executors_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    placements = place_executors(4, base_port=1000, gpu_memory_utilization=0.9, num_gpus=0, num_cpus=16)
    assert [p.env for p in placements] == [{"OMP_NUM_THREADS": "4"}] * 4
    assert place_executors(1, base_port=1000, gpu_memory_utilization=0.9, num_gpus=0)[0].env == {}
    with pytest.raises(ValueError):
        place_executors(0, base_port=1000, gpu_memory_utilization=0.9, num_gpus=0)
