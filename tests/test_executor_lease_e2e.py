"""Leases across schedulers against a real executor process (`--lease-timeout 2`), driven by two
stubs that play two schedulers: no stealing while a lease is live, expiry without heartbeats,
fencing of the old holder's Step stream, Detach, and a stepping scheduler never losing its lease."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.protos import executor_pb2, executor_pb2_grpc, wire
from tests.services import REPO, free_port
from tests.toy_scheduler import ToyScheduler

LEASE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def executor_address(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("lease-e2e") / "executor.log"
    cmd = [
        sys.executable, "-m", "pagedserve.executor", "--model", str(tiny_model_dir), "--port", str(port),
        "--device", "cpu", "--num-gpu-blocks-override", "64", "--swap-space", "0.01",
        "--max-model-len", "256", "--lease-timeout", str(LEASE_TIMEOUT_S),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT
        )
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=90)
            executor_pb2_grpc.ExecutorStub(channel).GetStats(executor_pb2.GetStatsRequest(), timeout=30)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()


class Scheduler:
    """One scheduler's view: its own channel (so its own peer address) and its Step stream."""

    def __init__(self, address: str, scheduler_id: str) -> None:
        self.scheduler_id = scheduler_id
        self.channel = grpc.insecure_channel(address)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self.epoch = 0
        self._plans: queue.Queue | None = None
        self._outputs = None

    def attach(self) -> executor_pb2.AttachResponse:
        info = self.stub.Attach(executor_pb2.AttachRequest(scheduler_id=self.scheduler_id), timeout=10)
        self.epoch = info.lease_epoch
        return info

    def open_stream(self) -> None:
        self._plans = queue.Queue()
        self._outputs = self.stub.Step(
            iter(self._plans.get, None), metadata=wire.lease_metadata(self.epoch), timeout=60
        )

    def step(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        self._plans.put(plan)
        return next(self._outputs)

    def next_output(self) -> executor_pb2.StepOutput:
        """Waits on the open stream without sending anything (an idle scheduler)."""
        return next(self._outputs)

    def heartbeat(self) -> None:
        self.stub.Heartbeat(executor_pb2.HeartbeatRequest(lease_epoch=self.epoch), timeout=10)

    def detach(self) -> None:
        self.stub.Detach(executor_pb2.DetachRequest(lease_epoch=self.epoch), timeout=10)

    def close(self) -> None:
        if self._plans is not None:
            self._plans.put(None)
        self.channel.close()


def _refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value


def test_a_second_scheduler_waits_for_the_lease_and_the_first_is_fenced(executor_address):
    a, b = Scheduler(executor_address, "sched-a"), Scheduler(executor_address, "sched-b")
    try:
        empty = _refused(a.stub.Attach, executor_pb2.AttachRequest(scheduler_id=""))
        assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT

        info = a.attach()
        assert info.lease_timeout_ms == LEASE_TIMEOUT_S * 1000
        a.open_stream()
        prompt = executor_pb2.NewRequest(
            seq_id=1,
            token_ids=[5, 6, 7],
            num_new_tokens=3,
            block_tables=[executor_pb2.BlockTable(block_ids=[0])],
        )
        assert list(a.step(executor_pb2.StepPlan(step_id=1, new_requests=[prompt])).seq_ids) == [1]

        # While A heartbeats, B is refused, told who holds the executor, past the timeout.
        deadline = time.monotonic() + 1.5 * LEASE_TIMEOUT_S
        while time.monotonic() < deadline:
            a.heartbeat()
            refused = _refused(b.attach)
            assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'sched-a'" in refused.details()
            assert "ipv4:127.0.0.1:" in refused.details()
            assert str(a.epoch) in refused.details()
            time.sleep(LEASE_TIMEOUT_S / 4)

        # A goes silent (its stream stays open): the lease expires and A's idle stream is cut.
        started = time.monotonic()
        cut = _refused(a.next_output)
        assert cut.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "expired" in cut.details()
        assert time.monotonic() - started < LEASE_TIMEOUT_S + 2

        b.attach()  # accepted now
        assert b.epoch > a.epoch
        stale = _refused(a.heartbeat)
        assert stale.code() == grpc.StatusCode.FAILED_PRECONDITION
        a.open_stream()  # the old holder's plans are refused (fenced by epoch)
        fenced = _refused(a.step, executor_pb2.StepPlan(step_id=2))
        assert fenced.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stale lease" in fenced.details()

        # The expiry freed A's request: B's executor does not know seq 1.
        b.open_stream()
        running = executor_pb2.RunningRequest(seq_id=1, num_new_tokens=1)
        unknown = _refused(b.step, executor_pb2.StepPlan(step_id=1, running=[running]))
        assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown" in unknown.details()

        # Detach hands the executor over at once; a stale Detach is refused.
        b.detach()
        assert _refused(b.detach).code() == grpc.StatusCode.FAILED_PRECONDITION
        a.attach()
        a.detach()
    finally:
        a.close()
        b.close()


def test_a_scheduler_that_keeps_stepping_never_loses_its_lease(executor_address):
    """Plans alone (no heartbeat) keep the lease: 2.5 timeouts of steps, each after a pause."""
    a, b = Scheduler(executor_address, "stepper"), Scheduler(executor_address, "intruder")
    try:
        info = a.attach()
        sched = ToyScheduler(info.num_gpu_blocks, info.num_cpu_blocks, info.block_size)
        sched.add(1, [42, 43, 44])
        a.open_stream()
        deadline = time.monotonic() + 2.5 * LEASE_TIMEOUT_S
        while time.monotonic() < deadline:
            sched.observe(a.step(sched.plan()))
            time.sleep(LEASE_TIMEOUT_S / 10)
        assert len(sched.seqs[1].generated) > 10
        assert _refused(b.attach).code() == grpc.StatusCode.FAILED_PRECONDITION
        a.detach()
    finally:
        a.close()
        b.close()
